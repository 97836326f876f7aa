"""Former import path of :mod:`afd_core.session.startup` (kept for code written before afd-core 0.7; the
module object is the same: ``afd_core.startup is afd_core.session.startup``). New code imports
:mod:`afd_core.session.startup`."""

import sys

import afd_core.session.startup as _target

sys.modules[__name__] = _target
