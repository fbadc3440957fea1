"""``xlatrain doctor``: tools that read an environment or a script without training anything.

- :mod:`xlatrain.doctor.environment`: the environment report (``collect``, ``render_text``,
  ``render_json``): which runtimes can run here and every known trap; the TPU PCI table and cache
  paths live in ``xlatrain.backend.hardware``.
- :mod:`xlatrain.doctor.script_check`: the static check of a training script (``check_file``): an
  engine that reads the script (``engine.py``) and one module per rule family.
- :mod:`xlatrain.doctor.cli`: ``add_doctor_parser`` for the ``xlatrain`` command line.

The in-run instrumentation (the end-of-fit report, compile watch, profiler trace) is
:mod:`xlatrain.diagnostics`, which imports nothing from here.
"""
