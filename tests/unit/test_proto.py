"""The committed generated protobuf code is what the .proto files produce today."""

from pathlib import Path

import pytest

from proto.generate import ROOT, generate

GENERATED = ["baton_pb2.py", "baton_pb2.pyi", "baton_pb2_grpc.py"]


@pytest.mark.parametrize("name", GENERATED)
def test_generated_code_is_fresh(tmp_path: Path, name: str):
    generate(tmp_path)
    fresh = (tmp_path / "proto" / name).read_text()
    committed = (ROOT / "proto" / name).read_text()
    assert fresh == committed, f"proto/{name} is stale: run `python -m proto.generate` and commit"


def test_messages_round_trip():
    from proto import baton_pb2 as pb

    request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(temperature=0.0, max_tokens=4))
    again = pb.GenerateRequest.FromString(request.SerializeToString())
    assert again.WhichOneof("input") == "prompt"
    assert again.sampling.HasField("temperature") and again.sampling.temperature == 0.0
    assert not again.sampling.HasField("top_p")
