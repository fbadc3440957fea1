"""Why a run is slow or broken: ``xlatrain doctor`` (environment and script checks), the
end-of-fit report, and readings of torch_xla's and torch.compile's own records.

Submodules are imported on use; none of them imports torch_xla at module level, so
``import xlatrain.diagnostics`` works without it.

- :mod:`xlatrain.diagnostics.doctor`: the environment report (``collect``, ``render_text``,
  ``render_json``); the TPU PCI table and cache paths live in ``xlatrain.backend.hardware``.
- :mod:`xlatrain.diagnostics.script_check`: static check of a training script (``check_file``).
- :mod:`xlatrain.diagnostics.xla_metrics`: ``snapshot()`` / ``diff()`` of torch_xla's counters.
- :mod:`xlatrain.diagnostics.run`: the end-of-fit report (``RunDiagnostics``, ``diagnostics.json``).
- :mod:`xlatrain.diagnostics.compile`: ``CompileWatch``, torch.compile's graph breaks and
  recompilations named with the user's line.
- :mod:`xlatrain.diagnostics.profile`: ``StepTrace``, a profiler trace of chosen training steps
  and its summary.
- :mod:`xlatrain.diagnostics.cli`: ``add_doctor_parser`` for the ``xlatrain`` command line.
"""
