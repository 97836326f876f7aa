"""Demo and test machinery, not needed to serve with AFD.

The ``afd demo`` runner (:mod:`.run`), the ``vllm serve`` process harness (:mod:`.servers`), the
completions client (:mod:`.client`), the parity comparison (:mod:`.parity`) and the tiny
checkpoints (:mod:`.tiny`). Their third-party dependencies (psutil, requests, tokenizers,
safetensors) come with afd-models' ``demo`` extra (included in ``cpu`` and ``cuda``) and are
imported only where used.
"""
