"""Reading a checkpoint back: which step a load reads (the resume rule), verified reads straight
into the caller's targets, global and resharded loads, loads from an object store,
verification (one engine for every root), and the streamed export. (Named ``loading``:
``asyncckpt.load`` is the function.)"""
