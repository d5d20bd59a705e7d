"""The prefill role: ``PrefillNode`` (lease creation when a prefill hands its blocks over, layer-wise progress)
and its ``Prefill`` / ``PrefillStream`` calls. Built on ``worker``; never imports ``decode_node``."""
