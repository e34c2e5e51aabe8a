"""The gRPC contract: generated code is up to date, and the .proto follows the protobuf style guide."""

from __future__ import annotations

import re
from pathlib import Path

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FileDescriptor

from lora_cache.api import regen
from lora_cache.api.servicer import RPCS
from lora_cache.api.v1 import lora_cache_service_pb2 as pb

PASCAL = re.compile(r"^[A-Z][A-Za-z0-9]*$")
SNAKE = re.compile(r"^[a-z][a-z0-9_]*$")
UPPER_SNAKE = re.compile(r"^[A-Z][A-Z0-9_]*$")
FILES: list[FileDescriptor] = [pb.DESCRIPTOR]


def test_regenerating_produces_no_diff(tmp_path: Path) -> None:
    written = regen.generate(tmp_path)
    assert {p.name for p in written} == {f"{f.stem}{s}" for f in regen.proto_files() for s in regen.SUFFIXES}
    fresh, current = regen.generated_files(tmp_path), regen.generated_files(regen.OUT)
    stale = sorted(n for n in fresh.keys() | current.keys() if fresh.get(n) != current.get(n))
    assert not stale, (f"generated code differs from protos/ for {stale}: run python -m lora_cache.api.regen "
                       "(with the grpcio-tools version pinned in pyproject.toml) and commit the result")


def test_every_proto_file_is_generated_into_the_package() -> None:
    names = {p.stem for p in regen.proto_files()}
    assert names == {Path(f.name).stem for f in FILES}, "a .proto file has no generated module (or the reverse)"
    for f in FILES:
        assert f.package == "lora_cache.v1"
        assert f.name.startswith("lora_cache/v1/"), f"{f.name}: the directory must match the package"


def test_the_rewrite_only_touches_imports_and_module_names() -> None:
    text = ("from lora_cache.v1 import x_pb2 as y\n"
            "_builder.Build(DESCRIPTOR, 'lora_cache.v1.x_pb2', g)\n'lora_cache.v1.Hint'")
    assert regen.rewrite(text) == ("from lora_cache.api.v1 import x_pb2 as y\n"
                                   "_builder.Build(DESCRIPTOR, 'lora_cache.api.v1.x_pb2', g)\n'lora_cache.v1.Hint'")


def test_services_and_rpcs_follow_the_style_guide() -> None:
    used: dict[str, str] = {}
    for f in FILES:
        for service in f.services_by_name.values():
            assert PASCAL.match(service.name) and service.name.endswith("Service"), service.name
            for m in service.methods:
                assert PASCAL.match(m.name), m.name
                assert m.input_type.name == f"{m.name}Request", f"{m.name} takes {m.input_type.name}"
                assert m.output_type.name == f"{m.name}Response", f"{m.name} returns {m.output_type.name}"
                for message in (m.input_type.full_name, m.output_type.full_name):
                    assert message not in used, f"{message} is used by {used[message]} and {m.name}"
                    used[message] = m.name


def test_messages_fields_and_enums_follow_the_style_guide() -> None:
    def check_message(d: Descriptor) -> None:
        assert PASCAL.match(d.name), f"message {d.name} is not PascalCase"
        for field in d.fields:
            assert SNAKE.match(field.name), f"{d.name}.{field.name} is not lower_snake_case"
            if field.is_repeated:
                assert field.name.endswith("s"), f"repeated field {d.name}.{field.name} should be plural"
        for nested in d.nested_types:
            check_message(nested)

    def check_enum(e: EnumDescriptor) -> None:
        prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", e.name).upper() + "_"
        assert e.values[0].number == 0 and e.values[0].name == f"{prefix}UNSPECIFIED", e.name
        for v in e.values:
            assert UPPER_SNAKE.match(v.name) and v.name.startswith(prefix), f"{e.name}.{v.name}"

    for f in FILES:
        for message in f.message_types_by_name.values():
            check_message(message)
        for enum in f.enum_types_by_name.values():
            check_enum(enum)


def test_the_servicer_serves_every_rpc_of_the_contract() -> None:
    service = pb.DESCRIPTOR.services_by_name["LoraCacheService"]
    assert set(RPCS) == {m.name for m in service.methods}
    for name, (request_cls, _) in RPCS.items():
        assert request_cls.DESCRIPTOR is service.methods_by_name[name].input_type
