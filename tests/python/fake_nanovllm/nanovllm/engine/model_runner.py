"""nano-vllm's `ModelRunner` call channel as nano-vllm-fork writes it: rank 0 pickles each call
into shared memory and sets an event per worker; a worker unpickles it, clears its event, then
runs it. Only the channel: `run` records what it was called with."""

import os
import pickle
from multiprocessing.shared_memory import SharedMemory


class ModelRunner:

    def __init__(self, rank, world_size, event, shm_name, log_dir):
        self.rank, self.world_size, self.event = rank, world_size, event
        self.log_dir = log_dir
        if rank == 0:
            self.shm = SharedMemory(name=shm_name, create=True, size=2**20)
        else:
            self.shm = SharedMemory(name=shm_name)
            self.loop()

    def run(self, seqs, is_prefill, *extra):
        with open(os.path.join(self.log_dir, f"run-rank-{self.rank}.log"), "a") as f:
            f.write(f"{seqs} {is_prefill} {[type(e).__name__ for e in extra]}\n")

    def exit(self):
        self.shm.close()
        if self.rank == 0:
            self.shm.unlink()

    def loop(self):
        while True:
            method_name, args = self.read_shm()
            self.call(method_name, *args)
            if method_name == "exit":
                break

    def read_shm(self):
        assert self.world_size > 1 and self.rank > 0
        self.event.wait()
        n = int.from_bytes(self.shm.buf[0:4], "little")
        method_name, *args = pickle.loads(self.shm.buf[4:n+4])
        self.event.clear()
        return method_name, args

    def write_shm(self, method_name, *args):
        assert self.world_size > 1 and self.rank == 0
        data = pickle.dumps([method_name, *args])
        n = len(data)
        self.shm.buf[0:4] = n.to_bytes(4, "little")
        self.shm.buf[4:n+4] = data
        for event in self.event:
            event.set()

    def call(self, method_name, *args):
        if self.world_size > 1 and self.rank == 0:
            self.write_shm(method_name, *args)
        method = getattr(self, method_name, None)
        return method(*args)
