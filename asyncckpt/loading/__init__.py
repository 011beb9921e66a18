"""Reading a checkpoint back: which step a load reads (the resume rule), verified reads straight
into the caller's targets, global and resharded loads, one loader for every root (a
directory, an object store, memory, tier mode's pair, a node's part of a step on the node-local
tiers) through ``Root.open_reader``,
verification (one engine for every root), and the streamed export. (Named ``loading``:
``asyncckpt.load`` is the function.)"""
