"""Build the cffi API-mode libfabric module in place: ``python -m disagg.fabric.build``.

ABI mode cannot work (nearly every libfabric call is a ``static inline`` in the headers), so
the module is compiled against ``rdma/fabric.h``. The build is skipped when the module that is
already there was built from the same declarations (its ``dg_build_hash()`` matches).

Headers: the system ones, or a directory given by ``--include DIR`` / ``DISAGG_FABRIC_INCLUDE``
(a copy of Debian's ``libfabric-dev`` ``usr/include``, for machines that only have the runtime).
Library: ``-lfabric``, or ``-l:libfabric.so.1`` where no unversioned ``libfabric.so`` exists.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

MODULE = "disagg.fabric._libfabric_cffi"
HERE = Path(__file__).resolve().parent

CDEF = r"""
typedef uint64_t fi_addr_t;
struct fid { ...; };
typedef struct fid *fid_t;
struct fid_fabric { struct fid fid; ...; };
struct fid_domain { struct fid fid; ...; };
struct fid_ep { struct fid fid; ...; };
struct fid_av { struct fid fid; ...; };
struct fid_cq { struct fid fid; ...; };
struct fid_mr { struct fid fid; ...; };
struct fid_eq { struct fid fid; ...; };
struct fid_wait { struct fid fid; ...; };

struct fi_tx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; size_t size; size_t iov_limit; size_t rma_iov_limit; ...; };
struct fi_rx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; size_t size; ...; };
struct fi_ep_attr { int type; uint32_t protocol; size_t max_msg_size; ...; };
struct fi_domain_attr {
    char *name; int threading; int control_progress; int data_progress; int resource_mgmt;
    int av_type; int mr_mode; size_t mr_key_size; size_t cq_data_size; size_t mr_iov_limit;
    ...;
};
struct fi_fabric_attr { char *name; char *prov_name; uint32_t prov_version; uint32_t api_version; ...; };
struct fi_info {
    struct fi_info *next; uint64_t caps; uint64_t mode; uint32_t addr_format;
    size_t src_addrlen; size_t dest_addrlen; void *src_addr; void *dest_addr;
    struct fi_tx_attr *tx_attr; struct fi_rx_attr *rx_attr; struct fi_ep_attr *ep_attr;
    struct fi_domain_attr *domain_attr; struct fi_fabric_attr *fabric_attr;
    ...;
};
struct fi_cq_attr { size_t size; uint64_t flags; int format; int wait_obj; int wait_cond; ...; };
struct fi_av_attr { int type; int rx_ctx_bits; size_t count; ...; };
struct fi_cq_data_entry { void *op_context; uint64_t flags; size_t len; void *buf; uint64_t data; };
struct fi_cq_err_entry {
    void *op_context; uint64_t flags; size_t len; void *buf; uint64_t data; uint64_t tag;
    size_t olen; int err; int prov_errno; void *err_data; size_t err_data_size; ...;
};
struct iovec { void *iov_base; size_t iov_len; };
struct fi_rma_iov { uint64_t addr; size_t len; uint64_t key; };
struct fi_msg_rma {
    const struct iovec *msg_iov; void **desc; size_t iov_count; fi_addr_t addr;
    const struct fi_rma_iov *rma_iov; size_t rma_iov_count; void *context; uint64_t data;
};
struct fi_mr_attr {
    const struct iovec *mr_iov; size_t iov_count; uint64_t access; uint64_t offset;
    uint64_t requested_key; void *context; int iface; ...;
};
struct fi_context2 { ...; };

#define FI_EP_RDM ...
#define FI_AV_TABLE ...
#define FI_CQ_FORMAT_DATA ...
#define FI_WAIT_NONE ...
#define FI_WAIT_UNSPEC ...
#define FI_WAIT_FD ...
#define FI_CQ_COND_NONE ...
#define FI_GETWAIT ...
#define FI_THREAD_SAFE ...
#define FI_THREAD_DOMAIN ...
#define FI_THREAD_COMPLETION ...
#define FI_PROGRESS_MANUAL ...
#define FI_HMEM_SYSTEM ...
#define FI_HMEM_CUDA ...

static const uint64_t FI_RMA, FI_WRITE, FI_REMOTE_WRITE, FI_READ, FI_REMOTE_READ, FI_HMEM;
static const uint64_t FI_TRANSMIT, FI_RECV, FI_REMOTE_CQ_DATA, FI_COMPLETION, FI_SOURCE;
static const uint64_t FI_CONTEXT, FI_CONTEXT2, FI_RX_CQ_DATA, FI_DELIVERY_COMPLETE;
static const int FI_MR_LOCAL, FI_MR_VIRT_ADDR, FI_MR_ALLOCATED, FI_MR_PROV_KEY, FI_MR_ENDPOINT;
static const int FI_MR_HMEM, FI_MR_RAW;
static const int FI_EAGAIN, FI_EAVAIL, FI_ENODATA, FI_ENOSYS, FI_ENOENT;
static const uint64_t FI_ADDR_UNSPEC;
static const int DG_VERSION;

uint32_t fi_version(void);
int fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
               const struct fi_info *hints, struct fi_info **info);
void fi_freeinfo(struct fi_info *info);
struct fi_info *fi_allocinfo(void);
struct fi_info *fi_dupinfo(const struct fi_info *info);
const char *fi_strerror(int errnum);
int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context);
int fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int fi_enable(struct fid_ep *ep);
int fi_close(struct fid *fid);
int fi_control(struct fid *fid, int command, void *arg);
int fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
                 uint64_t flags, void *context);
int fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
              uint64_t offset, uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
int fi_mr_regattr(struct fid_domain *domain, const struct fi_mr_attr *attr, uint64_t flags,
                  struct fid_mr **mr);
void *fi_mr_desc(struct fid_mr *mr);
uint64_t fi_mr_key(struct fid_mr *mr);
int fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int fi_mr_enable(struct fid_mr *mr);
ssize_t fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                     fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context);
ssize_t fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);
int fi_trywait(struct fid_fabric *fabric, struct fid **fids, int count);

char *strdup(const char *s);
int dg_mr_regattr(struct fid_domain *domain, void *addr, size_t len, uint64_t access,
                  uint64_t key, int iface, int device, struct fid_mr **mr);
const char *dg_build_hash(void);
size_t dg_context_size(void);
ssize_t dg_post_writes(struct fid_ep *ep, size_t n, const uint64_t *src_addr, const uint64_t *len,
                       void *desc, fi_addr_t dest, const uint64_t *dst_addr, uint64_t key,
                       uint64_t imm, char *ctx_base, const uint32_t *slots);
ssize_t dg_cq_drain(struct fid_cq *cq, struct fi_cq_data_entry *buf, size_t n, char *ctx_base,
                    size_t nctx, int64_t *slot_out, uint64_t *flags_out, uint64_t *data_out);
int dg_cq_wait_fd(struct fid_cq *cq);
int dg_trywait_cq(struct fid_fabric *fabric, struct fid_cq *cq);
ssize_t dg_bench_send(struct fid_ep *ep, struct fid_cq *cq, uint64_t src, void *desc,
                      fi_addr_t dest, uint64_t dst, uint64_t key, size_t page_size, size_t pages,
                      size_t window, uint64_t imm, int64_t timeout_ns);
ssize_t dg_bench_recv(struct fid_cq *cq, size_t expected, uint64_t imm, int64_t timeout_ns);
int dg_cuda_copy_runs(void *memcpy_async, size_t n, const uint64_t *dst, const uint64_t *src,
                      const uint64_t *len, void *stream);
"""

SOURCE = r"""
#include <string.h>
#include <stdlib.h>
#include <stdint.h>
#include <time.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>

#define DG_VERSION FI_VERSION(1, 17)

static const char *dg_build_hash(void) { return DG_BUILD_HASH; }
static size_t dg_context_size(void) { return sizeof(struct fi_context2); }

static int dg_mr_regattr(struct fid_domain *domain, void *addr, size_t len, uint64_t access,
                         uint64_t key, int iface, int device, struct fid_mr **mr) {
    struct iovec iov = { addr, len };
    struct fi_mr_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.mr_iov = &iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = key;
    attr.iface = (enum fi_hmem_iface)iface;
    if (iface == FI_HMEM_CUDA) attr.device.cuda = device;
    return fi_mr_regattr(domain, &attr, 0, mr);
}

static int64_t dg_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Post up to n writes with remote CQ data. Returns how many were posted before the provider
 * said -FI_EAGAIN (the caller progresses the CQ and posts the rest), or a negative error. */
static ssize_t dg_post_writes(struct fid_ep *ep, size_t n, const uint64_t *src_addr,
                              const uint64_t *len, void *desc, fi_addr_t dest,
                              const uint64_t *dst_addr, uint64_t key, uint64_t imm,
                              char *ctx_base, const uint32_t *slots) {
    size_t i;
    for (i = 0; i < n; i++) {
        void *ctx = ctx_base + (size_t)slots[i] * sizeof(struct fi_context2);
        ssize_t rc = fi_writedata(ep, (void *)(uintptr_t)src_addr[i], len[i], desc, imm, dest,
                                  dst_addr[i], key, ctx);
        if (rc == -FI_EAGAIN) return (ssize_t)i;
        if (rc < 0) return rc;
    }
    return (ssize_t)n;
}

/* Read up to n completions. Local completions are reported by context slot; target-side
 * completions (FI_REMOTE_CQ_DATA) get slot -1 and their immediate in data_out.
 * Returns the count, 0 when empty, -FI_EAVAIL when an error entry is waiting. */
static ssize_t dg_cq_drain(struct fid_cq *cq, struct fi_cq_data_entry *buf, size_t n,
                           char *ctx_base, size_t nctx, int64_t *slot_out, uint64_t *flags_out,
                           uint64_t *data_out) {
    ssize_t rc = fi_cq_read(cq, buf, n);
    if (rc == -FI_EAGAIN) return 0;
    if (rc < 0) return rc;
    for (ssize_t i = 0; i < rc; i++) {
        char *ctx = (char *)buf[i].op_context;
        int64_t slot = -1;
        if (!(buf[i].flags & FI_REMOTE_CQ_DATA) && ctx >= ctx_base &&
            ctx < ctx_base + nctx * sizeof(struct fi_context2))
            slot = (int64_t)((ctx - ctx_base) / sizeof(struct fi_context2));
        slot_out[i] = slot;
        flags_out[i] = buf[i].flags;
        data_out[i] = buf[i].data;
    }
    return rc;
}

static int dg_cq_wait_fd(struct fid_cq *cq) {
    int fd = -1;
    int rc = fi_control(&cq->fid, FI_GETWAIT, &fd);
    return rc < 0 ? rc : fd;
}

static int dg_trywait_cq(struct fid_fabric *fabric, struct fid_cq *cq) {
    struct fid *f = &cq->fid;
    return fi_trywait(fabric, &f, 1);
}

/* The C-style baseline: `pages` writes of `page_size` bytes, page i to dst + i * page_size,
 * at most `window` in flight, polling the CQ in a tight loop. Returns pages or an error. */
static ssize_t dg_bench_send(struct fid_ep *ep, struct fid_cq *cq, uint64_t src, void *desc,
                             fi_addr_t dest, uint64_t dst, uint64_t key, size_t page_size,
                             size_t pages, size_t window, uint64_t imm, int64_t timeout_ns) {
    struct fi_cq_data_entry ents[64];
    struct fi_context2 ctx;
    size_t posted = 0, done = 0;
    int64_t deadline = dg_now_ns() + timeout_ns;
    while (done < pages) {
        while (posted < pages && posted - done < window) {
            ssize_t rc = fi_writedata(ep, (void *)(uintptr_t)(src + posted * page_size),
                                      page_size, desc, imm, dest, dst + posted * page_size,
                                      key, &ctx);
            if (rc == -FI_EAGAIN) break;
            if (rc < 0) return rc;
            posted++;
        }
        ssize_t rc = fi_cq_read(cq, ents, 64);
        if (rc > 0) {
            for (ssize_t i = 0; i < rc; i++)
                if (!(ents[i].flags & FI_REMOTE_CQ_DATA)) done++;
        } else if (rc != -FI_EAGAIN) {
            return rc;
        }
        if (dg_now_ns() > deadline) return -FI_ETIMEDOUT;
    }
    return (ssize_t)done;
}

/* cuda-ipc's copy-engine path: one cuMemcpyAsync per run, issued from C. `memcpy_async` is
 * the driver's cuMemcpyAsync (looked up at run time, so no CUDA header or library is needed
 * to build). Returns 0 or the first CUresult that failed. */
typedef int (*dg_memcpy_async_fn)(uint64_t dst, uint64_t src, size_t n, void *stream);
static int dg_cuda_copy_runs(void *memcpy_async, size_t n, const uint64_t *dst,
                             const uint64_t *src, const uint64_t *len, void *stream) {
    dg_memcpy_async_fn f = (dg_memcpy_async_fn)memcpy_async;
    for (size_t i = 0; i < n; i++) {
        int rc = f(dst[i], src[i], (size_t)len[i], stream);
        if (rc != 0) return rc;
    }
    return 0;
}

/* The baseline's target: poll until `expected` completions carrying `imm` have arrived. */
static ssize_t dg_bench_recv(struct fid_cq *cq, size_t expected, uint64_t imm,
                             int64_t timeout_ns) {
    struct fi_cq_data_entry ents[64];
    size_t got = 0;
    int64_t deadline = dg_now_ns() + timeout_ns;
    while (got < expected) {
        ssize_t rc = fi_cq_read(cq, ents, 64);
        if (rc > 0) {
            for (ssize_t i = 0; i < rc; i++)
                if ((ents[i].flags & FI_REMOTE_CQ_DATA) && ents[i].data == imm) got++;
        } else if (rc != -FI_EAGAIN) {
            return rc;
        }
        if (dg_now_ns() > deadline) return -FI_ETIMEDOUT;
    }
    return (ssize_t)got;
}
"""


def _source_hash() -> str:
    h = hashlib.sha256()
    h.update(CDEF.encode())
    h.update(SOURCE.encode())
    h.update(sys.version.encode())
    return h.hexdigest()[:16]


def _include_dirs(explicit: str | None) -> list[str]:
    dirs = [d for d in (explicit or os.environ.get("DISAGG_FABRIC_INCLUDE", "")).split(":") if d]
    for d in dirs:
        if not Path(d, "rdma", "fabric.h").is_file():
            raise SystemExit(f"disagg.fabric.build: no rdma/fabric.h under {d}")
    return dirs


def _link_args(library_dirs: list[str]) -> tuple[list[str], list[str]]:
    """``-lfabric`` where ``libfabric.so`` exists, else the versioned soname."""
    search = library_dirs + [
        "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
        "/usr/local/lib", "/opt/amazon/efa/lib", "/opt/amazon/efa/lib64",
    ]
    if any(Path(d, "libfabric.so").exists() for d in search):
        return ["fabric"], []
    return [], ["-l:libfabric.so.1"]


def built_module_path() -> Path | None:
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    p = HERE / f"_libfabric_cffi{suffix}"
    return p if p.exists() else None


def up_to_date() -> bool:
    if built_module_path() is None:
        return False
    try:
        mod = importlib.import_module(MODULE)
    except ImportError:
        return False
    return bool(mod.ffi.string(mod.lib.dg_build_hash()).decode() == _source_hash())


def build(include: str | None = None, force: bool = False, verbose: bool = False) -> Path:
    if not force and up_to_date():
        path = built_module_path()
        assert path is not None
        return path
    import cffi

    digest = _source_hash()
    include_dirs = _include_dirs(include)
    lib_dirs = [d for d in os.environ.get("DISAGG_FABRIC_LIBDIR", "").split(":") if d]
    libraries, extra_link = _link_args(lib_dirs)
    ffi = cffi.FFI()
    ffi.cdef(CDEF)
    ffi.set_source(
        MODULE, SOURCE, include_dirs=include_dirs, library_dirs=lib_dirs, libraries=libraries,
        extra_link_args=extra_link, define_macros=[("DG_BUILD_HASH", f'"{digest}"')],
        extra_compile_args=["-O2", "-Wno-unused-function"],
    )
    with tempfile.TemporaryDirectory(prefix="disagg-fabric-build-") as tmp:
        out = ffi.compile(tmpdir=tmp, verbose=verbose)
        suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        target = HERE / f"_libfabric_cffi{suffix}"
        for old in glob.glob(str(HERE / "_libfabric_cffi*.so")):
            os.unlink(old)
        shutil.copyfile(out, target)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m disagg.fabric.build", description=__doc__)
    ap.add_argument("--include", help="directory holding rdma/fabric.h (default: system)")
    ap.add_argument("--force", action="store_true", help="rebuild even if up to date")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if not args.force and up_to_date():
        sys.stderr.write("disagg.fabric.build: up to date\n")
        return 0
    path = build(args.include, force=True, verbose=args.verbose)
    sys.stderr.write(f"disagg.fabric.build: built {path.name} in {time.perf_counter() - t0:.1f} s\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
