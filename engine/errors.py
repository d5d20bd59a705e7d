"""Typed errors of the engine; shells map them to gRPC / HTTP status codes."""


class BatonError(Exception):
    """Base of every error Baton raises on purpose."""


class InvalidRequest(BatonError, ValueError):
    """The request or one of its parameters is invalid; the message names the field."""


class CapacityExceeded(BatonError):
    """The request can never fit (or the queue is full): RESOURCE_EXHAUSTED."""


class ModelLoadError(BatonError):
    """A checkpoint folder is missing, malformed or of an unsupported architecture."""


class TensorParallelError(BatonError):
    """A tensor-parallel rank failed (it exited, hung past the timeout or could not load): the engine stops."""
