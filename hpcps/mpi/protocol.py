"""Message tags and the layout of parameter-server messages. No MPI calls here.

Every point-to-point message hpcps sends carries one of the :class:`Tag` values; no literal tag
appears anywhere else. A data message is one contiguous byte buffer: a header of
``HEADER_SLOTS`` float64 values (indices named by :class:`H`) followed by a float32 payload
(bfloat16 with ``--wire-dtype bf16``: :class:`Message`), so a
push or a parameter reply is a single MPI message with its bookkeeping attached. float64 holds
integers exactly up to 2**53, far beyond any step count.
"""
from __future__ import annotations

from enum import IntEnum

import numpy as np

from hpcps.compress import bf16
from hpcps.compress.bf16 import FP32, Wire


class Tag(IntEnum):
    """Point-to-point message kinds of the parameter server and of every run (all below 100:
    a strategy's own tags, declared in its package with
    :func:`hpcps.strategies.registry.message_tags`, start there)."""

    PUSH = 1          # replica -> shard: header + gradient slice
    FETCH = 2         # replica -> shard: header only, asks for the shard's parameters
    PARAMS = 3        # shard -> replica: header + parameter slice
    DONE = 4          # replica -> shard: this replica has pushed its last gradient
    PUSH_COMPRESSED = 7  # replica -> shard: header + compressed gradient message (bytes)
    PUSH_ACTIVATIONS = 17  # replica -> shard: header + k rows of layer inputs and errors
    # --trace: a clock ping between a rank and rank 0 at start (hpcps.runtime.timeline)
    TRACE_CLOCK = 18
    HEARTBEAT = 19    # replica -> shard: header only, "still alive" (--heartbeat-timeout)
    RESULT = 20       # any rank <-> reporter: final figures (pickled), when ranks may be lost
    EPOCH_DONE = 21   # replica -> server shard 0: share of epoch STEPS run (--epoch-quorum)
    EPOCH_END = 22    # server shard 0 -> replica: epoch STEPS ended (-1: nothing follows)
    # --ps-copies > 1 (hpcps.ps.replicated): a set's primary and its secondaries
    REPLICATE = 23    # primary -> secondary: a dense push it applied, as the replica sent it
    REPLICATE_PACKED = 24  # primary -> secondary: a compressed push it applied, as sent
    REPL_ACK = 25     # secondary -> primary: set SET holds its first PEER pushes
    PUSH_ACK = 26     # primary -> replica: push SEQ of set SET is committed
    NEW_PRIMARY = 27  # new primary -> replicas and shards: it serves set SET, shard PEER is dead
    SET_STATE = 28    # new primary -> secondary: set SET's whole state, replacing its copy
    FINAL_DONE = 29   # world rank 0 -> shards: it holds every set's final state; leave
    FINAL_SET = 30    # a set's primary -> world rank 0: the set's final state
    CKPT_SET = 31     # a set's primary -> the collector shard: the set's state at step STEPS
    # embedding tables (hpcps.ps.rows): a replica and the shards that hold its batch's rows
    PULL_ROWS = 32    # replica -> shard: header + (table, id) pairs, int64; EXAMPLES 1: create
    ROWS = 33         # shard -> replica: header + the rows of those pairs, float32, in order
    PUSH_ROWS = 34    # replica -> shard: header + (table, id) pairs + their row gradients
    ROWS_DONE = 35    # world rank 0 -> shards: the final evaluation has read its rows; leave
    SAVE_ROWS = 36    # world rank 0 -> shards: write your rows as of global step STEPS
    # spares (hpcps.ps.spares): replicas that die or leave, and the spares that replace them
    REPLICA_LOST = 37  # shard -> world rank 0: replica SENDER (world rank PEER) is lost
    REPLICA_LEFT = 38  # replica -> world rank 0: SENDER leaves the run (SIGTERM), all committed
    EXPECT = 39       # world rank 0 -> shards: replica SENDER joins now, at world rank PEER
    ASSIGN = 40       # world rank 0 -> a spare: what it becomes (pickled dict)
    RELEASE = 41      # world rank 0 -> an idle spare: the run is over, leave
    JOINED = 42       # a spare -> world rank 0: replica SENDER took its first step at CLOCK
    SHARD_LOST = 43   # shard -> world rank 0: shard PEER is dead (--ps-copies)
    HEAL = 44         # world rank 0 -> shards: shard PEER (a spare) holds dead shard SENDER's sets
    RESTORED = 45     # a spare shard -> world rank 0: it holds set SET whole since CLOCK
    # ranks that join a running job (hpcps.mpi.joins, --joins): pickled dicts
    JOIN_HELLO = 46   # newcomer -> listener, on their new intercommunicator: what it wants
    JOIN_WELCOME = 47  # the chief -> newcomer: its ranks and the job's configuration, or why not
    JOIN_READY = 48   # newcomer -> the chief: connected to every listener, ready to be a spare
    ROWS_SAVED = 49   # shard -> world rank 0: its rows of global step STEPS are written
    # no message carries it: a receive posted with it never completes, standing for one from
    # a peer that MPI reported dead (ULFM, hpcps.mpi.comm.Transport)
    NEVER = 99


def tag_name(tag: int) -> str:
    """A message tag's name (``PUSH``), or its number for a tag :class:`Tag` does not name (a
    strategy's own)."""
    try:
        return Tag(tag).name
    except ValueError:
        return f"tag {tag}"


class H(IntEnum):
    """Slots of the float64 message header."""

    VERSION = 0       # PUSH: shard version the gradient was computed from; PARAMS: shard version
    STEPS = 1         # PUSH: mini-batches this push covers; PARAMS: global steps applied so far
    LOSS_SUM = 2      # PUSH: sum of the training losses of those mini-batches; PARAMS: recent mean
    STALENESS = 3     # PARAMS: mean staleness of the pushes applied since the previous reply
    MAX_STALENESS = 4  # PARAMS: max staleness over the same window
    EXAMPLES = 5      # PUSH_ACTIVATIONS: rows k of inputs and errors in the message
    SENDER = 6        # replica index of the sender (for messages and error reports)
    VECTOR = 7        # sandblaster FETCH / SB_PUSH: which of the shard's vectors; as STOP below
    CLOCK = 8         # PARAMS under a staleness bound: steps completed by the slowest live replica
    UNPERSISTED = 9   # PARAMS with --persist-every: global steps applied since the last flush
    SET = 10          # --ps-copies > 1: which chunk set (a home shard's chunks) a message is of
    SEQ = 11          # --ps-copies > 1, PUSH: the replica's push count, 1, 2, ... (dedup, acks)
    PEER = 12         # NEW_PRIMARY: the shard found dead; SET_STATE, REPL_ACK: pushes applied
    # downpour's DONE from rank 0 and PARAMS: 1 when the run stops early (rank 0 stopped on a
    # signal in a run without a stop vote): push what you have and end. VECTOR's slot (an
    # alias: downpour never sends VECTOR), so that the header keeps its size
    STOP = 7


HEADER_SLOTS = len(H)
HEADER_BYTES = HEADER_SLOTS * 8


class Message:
    """A preallocated buffer for one header + ``n`` float32 values, sent in ``wire``'s format.

    ``buf`` is what MPI sends or receives; ``header`` is a view into it. With the float32 wire
    (the default) ``payload`` is a view too, so filling it and sending ``buf`` needs no copy or
    allocation on the hot path. With the bfloat16 wire (``--wire-dtype bf16``) the values travel
    as 16-bit ``words`` and ``payload`` is a float32 array beside the buffer: the sender fills
    ``payload`` and calls :meth:`pack` before sending, the receiver calls :meth:`unpack` after
    receiving (both do nothing on the float32 wire).
    """

    def __init__(self, n: int, wire: Wire = FP32):
        self.wire = wire
        self.buf = np.zeros(HEADER_BYTES + wire.itemsize * n, dtype=np.uint8)
        self.header = self.buf[:HEADER_BYTES].view(np.float64)
        if wire.bf16:
            self.words: np.ndarray | None = self.buf[HEADER_BYTES:].view(np.uint16)
            self.payload = np.zeros(n, dtype=np.float32)
        else:
            self.words = None
            self.payload = self.buf[HEADER_BYTES:].view(np.float32)

    def __len__(self) -> int:
        return len(self.payload)

    def fresh(self) -> "Message":
        """A new message of the same size and wire (to replace one MPI may still touch)."""
        return Message(len(self.payload), self.wire)

    def pack(self) -> None:
        """``payload`` into the buffer, in the wire's format (before sending)."""
        if self.words is not None:
            bf16.encode(self.payload, self.words)

    def unpack(self) -> None:
        """The buffer's values into ``payload`` (after receiving)."""
        if self.words is not None:
            bf16.decode(self.words, self.payload)


class ByteMessage:
    """A preallocated buffer for one header + up to ``max_bytes`` of variable-length payload.

    Used for compressed messages, whose size changes with every push: the sender fills
    ``body[:n]`` and sends ``spec(n)``; the receiver reads the size from the probe status.
    """

    def __init__(self, max_bytes: int):
        self.buf = np.zeros(HEADER_BYTES + max_bytes, dtype=np.uint8)
        self.header = self.buf[:HEADER_BYTES].view(np.float64)
        self.body = self.buf[HEADER_BYTES:]

    def spec(self, n: int) -> np.ndarray:
        """What to send: the header plus the first ``n`` payload bytes (a view, no copy)."""
        return self.buf[:HEADER_BYTES + n]
