"""Former import path of :mod:`afd_core.session.access` (kept for code written before afd-core 0.7; the
module object is the same: ``afd_core.access is afd_core.session.access``). New code imports
:mod:`afd_core.session.access`."""

import sys

import afd_core.session.access as _target

sys.modules[__name__] = _target
