"""What the benches (``bench/``) and the simulator (``sim/``) both read: the conversation trace and its scaling
(``trace``), synthetic workloads (``synthetic``), percentiles (``stats``) and plot setup (``plots``). Below both; it
imports nothing of Baton's."""
