"""AFD config, connector contract and registry, topology, transfer/control metadata, forward-context access, DBO hook, startup coordination and the torch.distributed P2P connector."""

from importlib.metadata import version as _version

__version__ = _version("afd-core")
