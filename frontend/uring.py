"""Many sockets' sends in one system call: a minimal io_uring, through ctypes.

Only the send operation, only non-blocking (MSG_DONTWAIT: a send that would block
completes at once with -EAGAIN, so `send_all` never waits). `open_ring()` answers None
where the kernel or its sandbox refuses io_uring; callers then write as before.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform
import struct

_SYS_SETUP, _SYS_ENTER = 425, 426  # the same numbers on x86_64 and aarch64
_OP_SEND = 26
_ENTER_GETEVENTS = 1
_FEAT_SINGLE_MMAP = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_FLAGS = 0x40 | 0x4000  # MSG_DONTWAIT | MSG_NOSIGNAL
_EAGAIN, _EINTR = 11, 4
# The first 40 of struct io_uring_sqe's 64 bytes: opcode flags ioprio fd off addr len
# msg_flags user_data. The rest stays as mapped (zeros): no send here sets it.
_SEND = struct.Struct("=BBHiQQIIQ")
_CQE = struct.Struct("=QiI")  # 16 bytes
_U32 = struct.Struct("=I")


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", ctypes.c_uint32 * 8),  # head tail mask entries flags dropped array resv1
        ("sq_user_addr", ctypes.c_uint64),
        ("cq_off", ctypes.c_uint32 * 8),  # head tail mask entries overflow cqes flags resv1
        ("cq_user_addr", ctypes.c_uint64),
    ]


class SendRing:
    """One io_uring for one thread's sends; `send_all` submits a batch and reaps it."""

    def __init__(self, entries: int = 256) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._syscall = libc.syscall
        self._syscall.restype = ctypes.c_long
        params = _Params()
        fd = self._syscall(_SYS_SETUP, entries, ctypes.byref(params))
        if fd < 0:
            raise OSError(ctypes.get_errno(), "io_uring_setup")
        self.fd = fd
        self._maps: list[mmap.mmap] = []
        try:
            self._map(params)
        except BaseException:
            self.close()
            raise
        self.entries = params.sq_entries
        self.broken = False  # set once an io_uring_enter fails: use the ring no more
        self._address = ctypes.pythonapi.PyBytes_AsString
        self._address.restype = ctypes.c_void_p
        self._address.argtypes = [ctypes.py_object]

    def _map(self, p: _Params) -> None:
        sq, cq = p.sq_off, p.cq_off
        sq_size = sq[6] + p.sq_entries * 4
        cq_size = cq[5] + p.cq_entries * 16
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | mmap.MAP_POPULATE
        if p.features & _FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        self._sq = mmap.mmap(self.fd, sq_size, flags, prot, offset=_OFF_SQ_RING)
        self._maps.append(self._sq)
        if p.features & _FEAT_SINGLE_MMAP:
            self._cq = self._sq
        else:
            self._cq = mmap.mmap(self.fd, cq_size, flags, prot, offset=_OFF_CQ_RING)
            self._maps.append(self._cq)
        self._sqes = mmap.mmap(self.fd, p.sq_entries * 64, flags, prot, offset=_OFF_SQES)
        self._maps.append(self._sqes)
        self._sq_tail, self._sq_mask = sq[1], _U32.unpack_from(self._sq, sq[2])[0]
        self._cq_head, self._cq_tail = cq[0], cq[1]
        self._cq_mask = _U32.unpack_from(self._cq, cq[2])[0]
        self._cqes = cq[5]
        for i in range(p.sq_entries):  # the submission array maps slot i to sqe i, once
            _U32.pack_into(self._sq, sq[6] + 4 * i, i)

    def send_all(self, sends: list[tuple[int, bytes]]) -> list[int]:
        """Send each (socket fd, data) without blocking: each one's bytes sent, or
        -errno (-EAGAIN for one never submitted, when the ring itself fails)."""
        results = [-_EAGAIN] * len(sends)
        for start in range(0, len(sends), self.entries):
            batch = sends[start : start + self.entries]
            taken = self._submit(batch, start)
            try:
                self._reap(taken, results)
            except OSError:  # sent, with results unknown
                self.broken = True
                raise
            if taken < len(batch):  # the rest stays -EAGAIN: the caller sends it
                self.broken = True
                break
        return results

    def _submit(self, batch: list[tuple[int, bytes]], first: int) -> int:
        sq, sqes, mask, address = self._sq, self._sqes, self._sq_mask, self._address
        tail = _U32.unpack_from(sq, self._sq_tail)[0]
        for i, (fd, data) in enumerate(batch):
            op = (_OP_SEND, 0, 0, fd, 0, address(data), len(data), _FLAGS, first + i)
            _SEND.pack_into(sqes, ((tail + i) & mask) * 64, *op)
        _U32.pack_into(sq, self._sq_tail, (tail + len(batch)) & 0xFFFFFFFF)
        taken = 0
        while taken < len(batch):  # the kernel takes entries in order
            try:
                taken += self._enter(len(batch) - taken, len(batch) - taken)
            except OSError:  # it took none this time; the ring is not entered again
                break
        return taken

    def _reap(self, count: int, results: list[int]) -> None:
        cq, mask, cqes = self._cq, self._cq_mask, self._cqes
        head = _U32.unpack_from(cq, self._cq_head)[0]
        while True:
            tail = _U32.unpack_from(cq, self._cq_tail)[0]
            while head != tail and count:
                user, res, _ = _CQE.unpack_from(cq, cqes + (head & mask) * 16)
                results[user] = res
                head = (head + 1) & 0xFFFFFFFF
                count -= 1
            _U32.pack_into(cq, self._cq_head, head)
            if not count:
                return
            self._enter(0, count)  # MSG_DONTWAIT sends complete as they are issued

    def _enter(self, submit: int, wait: int) -> int:
        while True:
            n = self._syscall(_SYS_ENTER, self.fd, submit, wait, _ENTER_GETEVENTS, None, 0)
            if n >= 0:
                return n
            err = ctypes.get_errno()
            if err != _EINTR:
                raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def close(self) -> None:
        for m in self._maps:
            m.close()
        self._maps = []
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_ring() -> SendRing | None:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        return None
    try:
        return SendRing()
    except OSError:
        return None
