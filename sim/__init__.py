"""``baton simulate``: a discrete-event simulator that runs Baton's real router against modelled workers.

Modules: ``hardware`` (GPU, link and model presets), ``timing`` (a step's time: roofline or measured curves),
``events`` (the simulated clock), ``kv_pool`` (Baton's BlockPool over block hashes), ``prefill_worker`` /
``decode_worker`` (the modelled engines), ``self_report`` (what a worker reports with its heartbeat), ``router``
(the real policy, rates and books, fed as the relay feeds them), ``cluster`` (workers, hosts, links, heartbeats,
index events), ``simulation`` (one run), ``workload`` (trace or synthetic requests with real block hashes),
``metrics``, ``plan`` (the real planner on the modelled workers' curves), ``report`` and ``cli`` (the shell);
``contention`` (workers sharing a host's cores), ``calibration`` / ``check`` / ``check_report`` / ``cpu_load``
(``baton simulate check``: calibrated here, compared with real runs), ``elastic`` (pools the real planner resizes)
and ``pools`` / ``pools_report`` (``baton simulate pools``: the planner judged at scale).
Nothing is imported here.
"""
