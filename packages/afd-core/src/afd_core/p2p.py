"""Former import path of :mod:`afd_core.connector.p2p` (kept for code written before afd-core 0.7; the
module object is the same: ``afd_core.p2p is afd_core.connector.p2p``). New code imports
:mod:`afd_core.connector.p2p`."""

import sys

import afd_core.connector.p2p as _target

sys.modules[__name__] = _target
