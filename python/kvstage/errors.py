"""Exceptions: every -errno of libkvstage becomes a KvstageError (an OSError)."""
import errno as _errno

from ._lib import lib


class KvstageError(OSError):
    """A libkvstage call failed: .errno (positive), .name ("ESTALE"), .func, .message (kvs_strerror's words)."""

    def __init__(self, err, func=None, message=None):
        err = abs(err)
        self.name = _errno.errorcode.get(err, f"E{err}")
        self.func = func
        self.message = message or lib.kvs_strerror(-err).decode(errors="replace")
        super().__init__(err, f"{func}: {self.message} ({self.name})" if func else f"{self.message} ({self.name})")

    def __reduce__(self):
        return (type(self), (self.errno, self.func, self.message))


class StaleLease(KvstageError):
    """ESTALE: an old epoch, or a room that is gone."""


class PoolExhausted(KvstageError):
    """ENOBUFS: no free slot (nothing was leased)."""


class NotConnected(KvstageError, ConnectionError):
    """ENOTCONN: the proxy is gone."""


class PermissionDenied(KvstageError, PermissionError):
    """EPERM/EACCES: someone else's slot, a wrong room token, or refused by the proxy."""


class Timeout(KvstageError, TimeoutError):
    """ETIMEDOUT: a sync call was not answered in time; the connection is unusable now."""


class Again(KvstageError, BlockingIOError):
    """EAGAIN: ring full, events waiting to be polled, or room not complete yet."""


class Busy(KvstageError):
    """EBUSY: the slot is in flight, or the room already has a sender."""


class BadHandle(KvstageError):
    """EBADF: a room (or client) that is closed, or a handle of the wrong role."""


class AlreadyDone(KvstageError):
    """EALREADY: the room is complete and takes no more chunks."""


class Aborted(KvstageError):
    """ECANCELED: the room was aborted."""


class NoDevice(KvstageError):
    """ENODEV: libkvstage_cuda is absent, or CUDA has no driver or device."""


_BY_ERRNO = {
    _errno.ESTALE: StaleLease,
    _errno.ENOBUFS: PoolExhausted,
    _errno.ENOTCONN: NotConnected,
    _errno.EPERM: PermissionDenied,
    _errno.EACCES: PermissionDenied,
    _errno.ETIMEDOUT: Timeout,
    _errno.EAGAIN: Again,
    _errno.EBUSY: Busy,
    _errno.EBADF: BadHandle,
    _errno.EALREADY: AlreadyDone,
    _errno.ECANCELED: Aborted,
    _errno.ENODEV: NoDevice,
}


def error(rc, func=None, message=None):
    """Returns the exception for a negative errno rc (its subclass, else KvstageError)."""
    return _BY_ERRNO.get(abs(rc), KvstageError)(rc, func, message)


def check(rc, func):
    """Returns rc when it is >= 0, raises error(rc, func) otherwise."""
    if rc < 0:
        raise error(rc, func)
    return rc
