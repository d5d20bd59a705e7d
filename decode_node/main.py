"""``baton decode``: run one decode worker (the shared worker CLI with the decode role)."""

from prefill_node.main import run


def main(argv: list[str]) -> int:
    return run("decode", argv)
