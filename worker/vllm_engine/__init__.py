"""vLLM as the engine of a Baton worker (``--engine vllm``): ``engine`` (vLLM's async engine behind the worker
seam), ``servicer`` (the worker API on it), ``node`` (the shell around them), ``blocks`` (vLLM's block events as
Baton's index entries), ``params`` (request values in vLLM's terms), ``leases`` (a vLLM prefill's leases), ``cli``
(the flags; nothing but ``engine`` and ``node`` imports vLLM)."""
