"""Calibrating the cost model on the user's own hardware (``docs/cost_model.md``, "Calibrate on your hardware").

Torch-free halves of the two calibrations; the timing lives in :mod:`megatron_dynbatch.measure` (offline) and
:mod:`megatron_dynbatch.megatron` (online, during training):

* :mod:`.grid` -- the micro-batch shares ``megatron-dynbatch calibrate`` times, ordered for a run cut short;
"""
