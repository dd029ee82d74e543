"""Errors of the contract: one base for the package, two rejections that promise safety.

Every error kvxfer raises on purpose is a KvxferError. The tree (in brackets, the module under
``kvxfer`` that defines the class or the package that exports it; a class without brackets is in
its parent's; this module imports none of them, it only draws them):

    KvxferError
    ├── InvalidSubmission        the submission is wrong; nothing escaped          [contract]
    │   └── LayoutMismatch       two ends' KV geometries cannot meet               [contract.geometry]
    ├── SubmissionRejected       not now (shut down, backpressure); nothing escaped [contract]
    ├── WireError                a message is malformed, oversized or wrongly signed [wire]
    ├── LeaseError               a lease or lender used wrongly                    [lender.errors]
    │   ├── LendingDisabled      the pool's reuse scope changed, or the lender shut down
    │   ├── LenderBusy           shutdown() while leases are open
    │   ├── AlreadyLent          a second lender over memory a live lender lends
    │   └── BlocksBusy           an engine frees blocks a transfer may still touch
    ├── PoolExhausted            no free block for a request                       [pool]
    ├── UnknownRequest           the pool holds no such request                    [pool]
    ├── RowCopyError             a native row copy refused or failed               [native]
    ├── IpcUnavailable           CUDA IPC cannot run here (and why)                [backends.ipc]
    ├── PeerBusy                 an IPC peer is busy now; also an OSError          [backends.ipc.channel]
    ├── PeerGone                 a NIXL peer disconnected                          [backends.nixl.agent]
    ├── PeerUnknown              a NIXL peer's metadata is not loaded (yet)        [backends.nixl.agent]
    ├── XferError                NIXL refused or failed a request                  [backends.nixl.agent]
    ├── UcxUnavailable           the ucx backend cannot run here (no ucxx, or UCX failed) [backends.ucx.transport]
    ├── UcxPeerGone              a ucx peer disconnected or cannot be reached      [backends.ucx.transport]
    ├── StoreError               a KV store cannot be used at all (connect, set-up, closed) [backends.blob.driver]
    ├── HttpError                an HTTP exchange failed (refused, cut, status)    [serving.exchange]
    ├── BadRequest               a client sent something malformed: 400            [serving.exchange]
    ├── InvalidKey               a key that cannot be used; also a ValueError      [serving.keys]
    ├── RecordError              a worker's discovery record cannot be read; also a ValueError [serving.discovery]
    ├── EtcdUnavailable          etcd did not answer in time, or refused the call  [etcd.client]
    ├── InvalidRequest           the router refuses a request; also a ValueError   [router.inputs]
    │   └── MixedEngines         the router's workers run different engines
    ├── OpenAIError              a request answered in OpenAI's error shape        [router.openai_api]
    │   └── ClientGone           the client left before its whole answer: 499      [router.frontend]
    ├── Failure                  a request failed at a worker (dead, or unavailable) [router.run]
    ├── Refused                  a worker refuses a call as it stands: 400         [worker.errors]
    ├── Aborted                  a /prefill or /reserve aborted while it ran: 409  [worker.errors]
    ├── ProbeError               a lane-probe call refused                         [worker.probe]
    │   ├── ProbeInvalid         it asks for what no probe can be
    │   ├── ProbeBusy            another probe is open, or the worker is stopping
    │   └── ProbeUnknown         no open probe has that id
    ├── ProcessFailed            a launched worker or router did not come up       [worker.procs]
    ├── PullOverTcp              a pull lane would run over TCP                    [pair.lanes]
    ├── PeerError                `kvxfer doctor --peer`: the worker cannot be probed [doctor.peer]
    ├── LaunchError              `kvxfer launch` cannot go on                      [launch.launcher]
    ├── CheckpointError          a model checkpoint cannot be loaded               [modelfiles.errors]
    ├── AdapterError             an engine adapter cannot do what was asked        [adapters.errors]
    │   ├── EngineVersionError   the installed engine is not the pinned version
    │   ├── EngineMismatch       the two ends run different engines
    │   └── UnsupportedCache     the engine's cache has a shape not lent (sliding window)
    ├── InvalidSampling          a sampling parameter is bad; also a ValueError    [engine.sampling]
    ├── ConfigError              a bench option is wrong; also a ValueError        [bench.config]
    ├── ResultError              a bench result file is wrong; also a ValueError   [bench.results]
    ├── Skip                     a bench case cannot run here (and why)            [bench.cases]
    ├── CopyError                the host stand-in for the native module's error   [testing.host_cuda]
    └── NetnsError               an `ip` or `nft` command failed; also a RuntimeError [testing.netns]

Classes whose names start with ``_`` are private to their module and not drawn: the module
raises and catches them itself, or lets them out only as their public base (``launch.cli``'s
``_Interrupted``, a KeyboardInterrupt, is a signal arriving, not an error).
``tests/unit/test_error_tree.py`` keeps the tree whole: every public exception class in the
package is a KvxferError drawn under its base, in its module, and the tree draws nothing else.
PeerBusy, PeerGone, PeerUnknown, XferError and UcxPeerGone stay inside their backends, which
turn them into outcomes or the two rejections. The compiled module's own
``kvxfer._native.CopyError`` is not in the tree: ``kvxfer.native`` turns it into RowCopyError,
and the IPC backend into outcomes.
"""

from __future__ import annotations


class KvxferError(Exception):
    """Base of every error kvxfer raises on purpose."""


class InvalidSubmission(KvxferError):
    """The submission is wrong and will never be accepted as it stands.

    Raised for rows in no registered region, overlapping rows in one fetch, a layout or
    mode mismatch with the peer's hint, or malformed masks. Nothing escaped: no memory was
    touched and no peer was told, so the caller may end its lease at once.
    """


class SubmissionRejected(KvxferError):
    """The submission is well formed but cannot be taken now (backpressure, shut down).

    Nothing escaped: no memory was touched and no peer was told, so the caller may end its
    lease at once or try again later.
    """


def one_line(exc: BaseException) -> str:
    """An error's message on one line (what a CLI prints after "error:", what /health shows)."""
    return " ".join(str(exc).split())
