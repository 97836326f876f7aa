"""AFD model adapters (import vLLM; loaded lazily by the plugin through ModelRegistry)."""
