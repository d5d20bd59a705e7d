"""The decode role: ``DecodeNode`` (reserve -> pull -> activate, first tokens of layer-wise requests, local
prefill as the fallback) and its ``Decode`` / ``FirstToken`` calls. Built on ``worker``; never imports ``prefill_node``."""
