"""Benchmark machinery behind ``transfer-bench`` (private: no stable API).

Layout:

- :mod:`.common`   sizes, configuration, the per-batch fill, checksum selection
- :mod:`.limits`   physical limits measured in-process (memcpy, one-core read)
- :mod:`.channels` one producer/consumer channel per method (``transfer`` and
  the baselines: pyzmq PUSH/PULL, multiprocessing Queue/Pipe, hand-rolled
  shared memory + pipe notification, torch.multiprocessing, iceoryx2
  publish-subscribe, raw NIXL READs for the remote mode)
- :mod:`.latency`  one small request in flight, its round trip, per method
- :mod:`.workers`  the producer and consumer process entry points (the same
  generic loop for every method, so every method does the same work)
- :mod:`.runner`   orchestration: cells, repetitions, timing, cleanup
- :mod:`.report`   machine description, table, JSON, plot
"""
