"""The checkpoint format, pure (no I/O, no threads): structure codec, safetensors header and
shard layout, manifest, global index, names on disk, CRC-32C, reader bounds, the step-state
rule, the save lifecycle, DTensor layouts and resharding math."""
