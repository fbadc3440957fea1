"""Why a run is slow or broken, measured while it runs: the end-of-fit report, and readings of
torch_xla's and torch.compile's own records. The offline tools (``xlatrain doctor``: the
environment report and the script check) live in :mod:`xlatrain.doctor`.

Submodules are imported on use; none of them imports torch_xla at module level, so
``import xlatrain.diagnostics`` works without it.

- :mod:`xlatrain.diagnostics.xla_metrics`: ``snapshot()`` / ``diff()`` of torch_xla's counters.
- :mod:`xlatrain.diagnostics.run`: the end-of-fit report (``RunDiagnostics``, ``diagnostics.json``).
- :mod:`xlatrain.diagnostics.compile`: ``CompileWatch``, torch.compile's graph breaks and
  recompilations named with the user's line.
- :mod:`xlatrain.diagnostics.profile`: ``StepTrace``, a profiler trace of chosen training steps
  and its summary.

``xlatrain.diagnostics.doctor``, ``.script_check`` and ``.cli`` are the modules of
``xlatrain.doctor`` under their earlier names.
"""
