"""How a job keeps its request (generator_service.serving.convert): split into a slim message and its large parts,
joined back unchanged; and what it means (generator_service.jobs.types.spec_meaning), the same for a request with
its fields unset or filled in, a file inline or uploaded, any request_id."""

from __future__ import annotations

import hashlib

from refmedia import image_bytes

from ditcore import GenerationRequest
from ditcore.references import Reference
from ditserve.client_requests import request_to_proto
from generator_service.jobs.types import job_spec, spec_meaning
from generator_service.serving.convert import join_parts, request_from_proto, request_meaning, split_parts
from protos.ditserve.generator.v1 import generator_pb2 as pb

PNG, JPG = image_bytes(64, 48, seed=1), image_bytes(48, 64, seed=2, fmt="JPEG")


def test_split_then_join_is_the_same_message() -> None:
    msg = pb.GenerateRequest(prompt="a red fox", first_frame=PNG, last_frame=JPG, references=[
        pb.Reference(data=PNG, kind=pb.REFERENCE_KIND_IMAGE), pb.Reference(data=b"", kind=pb.REFERENCE_KIND_IMAGE)])  # fmt: skip
    want = msg.SerializeToString(deterministic=True)
    slim, parts = split_parts(msg)
    assert set(parts) == {"first_frame", "last_frame", "references[0]"} and len(slim) < 200
    assert join_parts(slim, parts).SerializeToString(deterministic=True) == want


def test_one_meaning_for_unset_or_filled_fields_inline_or_uploaded_files_and_any_request_id() -> None:
    sparse = pb.GenerateRequest(prompt="a red fox", num_inference_steps=3,
                                references=[pb.Reference(data=PNG, kind=pb.REFERENCE_KIND_IMAGE)])  # fmt: skip
    filled = request_to_proto(GenerationRequest(prompt="a red fox", num_inference_steps=3, request_id="mine",
                                                task="ref2va", references=(Reference(PNG, "image"),)))  # fmt: skip
    assert filled.task == pb.TASK_REF2VA and filled.HasField("seed")
    filled.references[0].upload_id = "upl_" + "1" * 32  # the same file, uploaded (the oneof drops its data)
    uploads = {"upl_" + "1" * 32: (hashlib.sha256(PNG).hexdigest(), len(PNG))}
    parsed, expected = request_from_proto(sparse)
    stored = spec_meaning(job_spec(parsed, expected, {}))  # what CreateJob stores for the sparse one
    assert request_meaning(sparse, uploads.get) == stored
    assert request_meaning(filled, uploads.get) == stored  # filled in, uploaded, another request_id
    other = pb.GenerateRequest(prompt="a red fox", num_inference_steps=4)
    assert request_meaning(other, uploads.get) != stored
