"""Tests of flowrl.graph: IR, builder, validation, serialisation, loading and export."""
