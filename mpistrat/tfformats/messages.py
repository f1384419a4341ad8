"""TensorFlow's protocol buffer messages, defined here (not copied from TensorFlow).

The fields below follow TensorFlow's ``.proto`` files (``tensor_bundle.proto``,
``tensor_shape.proto``, ``tensor_slice.proto``, ``versions.proto``,
``trackable_object_graph.proto``, ``example.proto``, ``feature.proto``, ``event.proto``,
``summary.proto``); only the wire
format matters, so enums are plain integers and ``google.protobuf.BoolValue`` is a local
message of the same shape. Where the ``protobuf`` package is installed, message classes are
built from these definitions at first use in a private descriptor pool (so they never clash
with TensorFlow's own, should both be loaded); without it, :mod:`wire` parses the same
definitions in pure Python (slower: docs/benchmarks.md). Either way callers see the same
attributes::

    >>> from mpistrat.tfformats import messages
    >>> data = messages.serialize("VersionDef", {"producer": 1, "bad_consumers": [3]})
    >>> version = messages.parse("VersionDef", data, "a test")
    >>> version.producer, list(version.bad_consumers)
    (1, [3])
"""

import functools
from typing import Any, Dict

from mpistrat.errors import DataLossError
from mpistrat.tfformats import wire
from mpistrat.tfformats.wire import Field

__all__ = ["SCHEMA", "parse", "serialize", "backend", "message_class"]

_PACKAGE = "mpistrat_tf"

SCHEMA: Dict[str, list] = {
    # tensor_bundle.proto and what it uses
    "VersionDef": [Field(1, "producer", "int32"), Field(2, "min_consumer", "int32"),
                   Field(3, "bad_consumers", "int32", True)],
    "TensorShapeProto": [Field(2, "dim", "TensorShapeProto.Dim", True),
                         Field(3, "unknown_rank", "bool")],
    "TensorShapeProto.Dim": [Field(1, "size", "int64"), Field(2, "name", "string")],
    "TensorSliceProto": [Field(1, "extent", "TensorSliceProto.Extent", True)],
    "TensorSliceProto.Extent": [Field(1, "start", "int64"),
                                Field(2, "length", "int64", oneof="has_length")],
    "BundleHeaderProto": [Field(1, "num_shards", "int32"), Field(2, "endianness", "enum"),
                          Field(3, "version", "VersionDef")],
    "BundleEntryProto": [Field(1, "dtype", "enum"), Field(2, "shape", "TensorShapeProto"),
                         Field(3, "shard_id", "int32"), Field(4, "offset", "int64"),
                         Field(5, "size", "int64"), Field(6, "crc32c", "fixed32"),
                         Field(7, "slices", "TensorSliceProto", True)],
    # trackable_object_graph.proto
    "BoolValue": [Field(1, "value", "bool")],
    "RegisteredSaver": [Field(1, "name", "string"), Field(2, "object_name", "string")],
    "TrackableObjectGraph": [Field(1, "nodes", "TrackableObjectGraph.TrackableObject", True)],
    "TrackableObjectGraph.TrackableObject": [
        Field(1, "children", "TrackableObjectGraph.TrackableObject.ObjectReference", True),
        Field(2, "attributes", "TrackableObjectGraph.TrackableObject.SerializedTensor", True),
        Field(3, "slot_variables",
              "TrackableObjectGraph.TrackableObject.SlotVariableReference", True),
        Field(4, "registered_saver", "RegisteredSaver"),
        Field(5, "has_checkpoint_values", "BoolValue")],
    "TrackableObjectGraph.TrackableObject.ObjectReference": [
        Field(1, "node_id", "int32"), Field(2, "local_name", "string")],
    "TrackableObjectGraph.TrackableObject.SerializedTensor": [
        Field(1, "name", "string"), Field(2, "full_name", "string"),
        Field(3, "checkpoint_key", "string"), Field(4, "optional_restore", "bool")],
    "TrackableObjectGraph.TrackableObject.SlotVariableReference": [
        Field(1, "original_variable_node_id", "int32"), Field(2, "slot_name", "string"),
        Field(3, "slot_variable_node_id", "int32")],
    # example.proto and feature.proto
    "Example": [Field(1, "features", "Features")],
    "Features": [Field(1, "feature", "Features.FeatureEntry", True, map=True)],
    "Features.FeatureEntry": [Field(1, "key", "string"), Field(2, "value", "Feature")],
    "SequenceExample": [Field(1, "context", "Features"),
                        Field(2, "feature_lists", "FeatureLists")],
    "FeatureLists": [Field(1, "feature_list", "FeatureLists.FeatureListEntry", True, map=True)],
    "FeatureLists.FeatureListEntry": [Field(1, "key", "string"),
                                      Field(2, "value", "FeatureList")],
    "FeatureList": [Field(1, "feature", "Feature", True)],
    # event.proto and summary.proto: TensorBoard's event files (scalars only)
    "Event": [Field(1, "wall_time", "double"), Field(2, "step", "int64"),
              Field(3, "file_version", "string", oneof="what"),
              Field(5, "summary", "Summary", oneof="what")],
    "Summary": [Field(1, "value", "Summary.Value", True)],
    "Summary.Value": [Field(1, "tag", "string"), Field(2, "simple_value", "float", oneof="value")],
    "Feature": [Field(1, "bytes_list", "BytesList", oneof="kind"),
                Field(2, "float_list", "FloatList", oneof="kind"),
                Field(3, "int64_list", "Int64List", oneof="kind")],
    "BytesList": [Field(1, "value", "bytes", True)],
    "FloatList": [Field(1, "value", "float", True)],
    "Int64List": [Field(1, "value", "int64", True)],
}


@functools.lru_cache(maxsize=None)
def _pool():
    """Our messages in a private descriptor pool, or ``None`` without the protobuf package."""
    try:
        from google.protobuf import descriptor_pb2, descriptor_pool
    except ImportError:
        return None
    proto = descriptor_pb2.FieldDescriptorProto
    types = {"int32": proto.TYPE_INT32, "int64": proto.TYPE_INT64, "enum": proto.TYPE_INT32,
             "uint64": proto.TYPE_UINT64, "bool": proto.TYPE_BOOL, "string": proto.TYPE_STRING,
             "bytes": proto.TYPE_BYTES, "fixed32": proto.TYPE_FIXED32,
             "float": proto.TYPE_FLOAT, "double": proto.TYPE_DOUBLE}
    file = descriptor_pb2.FileDescriptorProto(name="mpistrat_tensorflow_messages.proto",
                                              package=_PACKAGE, syntax="proto3")
    made: Dict[str, Any] = {}
    for name in sorted(SCHEMA, key=lambda n: n.count(".")):    # parents before nested ones
        parent, _, short = name.rpartition(".")
        message = (made[parent].nested_type if parent else file.message_type).add(name=short)
        made[name] = message
        if any(f.map for fields in SCHEMA.values() for f in fields if f.kind == name):
            message.options.map_entry = True
        oneofs: list = []
        for field in SCHEMA[name]:
            entry = message.field.add(name=field.name, number=field.number,
                                      label=proto.LABEL_REPEATED if field.repeated
                                      else proto.LABEL_OPTIONAL)
            if field.kind in types:
                entry.type = types[field.kind]
            else:
                entry.type, entry.type_name = proto.TYPE_MESSAGE, f".{_PACKAGE}.{field.kind}"
            if field.oneof is not None:
                if field.oneof not in oneofs:
                    oneofs.append(field.oneof)
                    message.oneof_decl.add(name=field.oneof)
                entry.oneof_index = oneofs.index(field.oneof)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool


@functools.lru_cache(maxsize=None)
def message_class(name: str):
    """The protobuf class of message ``name``, or ``None`` without the protobuf package."""
    pool = _pool()
    if pool is None:
        return None
    from google.protobuf import message_factory
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}"))


def backend() -> str:
    """``"protobuf"`` or ``"python"``: which parses messages in this process."""
    return "protobuf" if _pool() is not None else "python"


def parse(name: str, data, where: str):
    """Message ``name`` from ``data``; ``DataLossError`` naming ``where`` if it is malformed."""
    cls = message_class(name)
    try:
        if cls is None:
            return wire.decode(SCHEMA, name, memoryview(data))
        return cls.FromString(bytes(data))
    except Exception as err:  # noqa: BLE001 - protobuf's DecodeError, our WireError, ...
        raise DataLossError(f"{where}: not a valid {name} message ({type(err).__name__}: "
                            f"{err})") from None


def serialize(name: str, fields: dict) -> bytes:
    """The encoding of message ``name`` holding ``fields`` (nested messages as dicts)."""
    cls = message_class(name)
    if cls is None:
        return wire.encode(SCHEMA, name, fields)
    message = cls()
    _fill(message, name, fields)
    return message.SerializeToString(deterministic=True)


def _fill(message, name: str, fields: dict) -> None:
    for field in SCHEMA[name]:
        value = fields.get(field.name)
        if value is None:
            continue
        target = getattr(message, field.name)
        nested = field.kind in SCHEMA
        if field.map:
            value_kind = next(f.kind for f in SCHEMA[field.kind] if f.name == "value")
            for key, item in value.items():
                _fill(target[key], value_kind, item)
        elif field.repeated and nested:
            for item in value:
                _fill(target.add(), field.kind, item)
        elif field.repeated:
            target.extend(value)
        elif nested:
            target.SetInParent()  # present even when empty
            _fill(getattr(message, field.name), field.kind, value)
        else:
            setattr(message, field.name, value)
