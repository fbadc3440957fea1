"""Moved to :mod:`xlatrain.doctor.script_check`: the offline tools (``xlatrain doctor``: the environment report
and the script check) live in ``xlatrain.doctor``, apart from the in-run diagnostics. This name
stays the same module for code that imports it from here."""

import sys

from xlatrain.doctor import script_check as _moved

sys.modules[__name__] = _moved
