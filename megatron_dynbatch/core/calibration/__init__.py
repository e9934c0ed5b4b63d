"""Calibrating the cost model on the user's own hardware (``docs/cost_model.md``, "Calibrate on your hardware").

Torch-free halves of the two calibrations; the timing lives in :mod:`megatron_dynbatch.measure` (offline) and
:mod:`megatron_dynbatch.megatron` (online, during training):

* :mod:`.grid` -- the micro-batch shares ``megatron-dynbatch calibrate`` times, ordered for a run cut short;
* :mod:`.timebox` -- the time that grid takes, and the grid cut to ``--max-seconds``;
* :mod:`.setup` -- one validated calibration run (what ``calibrate --dry-run`` prints);
* :mod:`.compare` -- what a new model changes: a batch's predicted step time, same plan and re-planned;
* :mod:`.report` -- the fit error per group size and the fitted profile in words;
* :mod:`.records` -- what online calibration records (a rank's timings and the slice they cover);
* :mod:`.shared` -- the vector every rank sums after a refit, and the shared profile built from the sum;
* :mod:`.online` -- ``OnlineCalibration``: the window, the refit schedule, the prior, the log.
"""
