"""An analytical A:F capacity planner for AFD deployments (``afd plan``).

Submodules, one job each (none imports vLLM or torch itself; the error types are afd-core's):

* :mod:`afd_plan.shape` -- :class:`ModelShape` from a Hugging Face ``config.json``.
* :mod:`afd_plan.hardware` -- :class:`HardwareProfile` files and the shipped profiles.
* :mod:`afd_plan.workload` -- :class:`Workload` (lengths, KV / weight formats, routing).
* :mod:`afd_plan.cost` -- the per-layer cost terms (roofline compute, transfers).
* :mod:`afd_plan.plan` -- predictions for one deployment, the memory check, the search.
* :mod:`afd_plan.report` -- table / JSON rendering and the optional plot.
"""

from importlib.metadata import version as _version

from afd_plan.errors import AFDPlanError, AFDPlanMemoryError
from afd_plan.hardware import (
    DEFAULT_PROFILE,
    HardwareProfile,
    load_profile,
    profile_from_mapping,
    shipped_profiles,
)
from afd_plan.plan import Candidate, PlanResult, Prediction, check_memory, predict, search
from afd_plan.shape import AttentionShape, ModelShape, load_model_shape, shape_from_config
from afd_plan.workload import Workload

__version__ = _version("afd-plan")

__all__ = [
    "DEFAULT_PROFILE",
    "AFDPlanError",
    "AFDPlanMemoryError",
    "AttentionShape",
    "Candidate",
    "HardwareProfile",
    "ModelShape",
    "PlanResult",
    "Prediction",
    "Workload",
    "__version__",
    "check_memory",
    "load_model_shape",
    "load_profile",
    "predict",
    "profile_from_mapping",
    "search",
    "shape_from_config",
    "shipped_profiles",
]
