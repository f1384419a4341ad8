"""TensorFlow's file formats, read and written without TensorFlow (layer 0: no MPI).

* :mod:`crc` CRC-32C and TensorFlow's masked form of it;
* :mod:`wire`, :mod:`messages` the protocol buffer messages TensorFlow stores (protobuf's
  classes built from our definitions, or a pure-Python wire reader where it is missing);
* :mod:`sstable` LevelDB's sorted table, the layout of a checkpoint's ``.index``;
* :mod:`bundle` the tensor bundle (``.index`` + ``.data-*`` shards);
* :mod:`object_graph` TF2's ``_CHECKPOINTABLE_OBJECT_GRAPH``;
* :mod:`records` TFRecord framing.

The MPI parts live where they are used: ``checkpoint/tf_checkpoints.py`` (restores),
``data/tfrecord.py`` (datasets).
"""
