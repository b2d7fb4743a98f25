"""A stranger on the decoder's host with plain libfabric: its own endpoint, its own minimal cffi
module (compiled on first use, nothing shared with ``disagg.fabric``), raw ``fi_writedata`` /
``fi_write`` / ``fi_read`` against any endpoint address, key and offset it likes.

It knows what a local attacker could: the decoder's endpoint address and descriptors of
attempts that are over (e.g. from an old ``PrefillRequest``), never a live key.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

CDEF = r"""
struct atk;
struct atk *atk_open(const char *prov, size_t buflen);
void atk_close(struct atk *a);
char *atk_buf(struct atk *a);
int atk_peer(struct atk *a, const char *addr, size_t addrlen, uint64_t *out);
int atk_ops(struct atk *a, int op, uint64_t peer, size_t n, const uint64_t *raddr,
            const uint64_t *key, const uint64_t *imm, size_t len, int timeout_ms,
            int *errs);
"""

SOURCE = r"""
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>

struct atk {
    struct fi_info *info; struct fid_fabric *fabric; struct fid_domain *domain;
    struct fid_ep *ep; struct fid_av *av; struct fid_cq *cq; struct fid_mr *mr;
    char *buf; size_t buflen; struct fi_context2 *ctx; size_t nctx;
};

void atk_close(struct atk *a) {
    if (!a) return;
    if (a->ep) fi_close(&a->ep->fid);
    if (a->mr) fi_close(&a->mr->fid);
    if (a->cq) fi_close(&a->cq->fid);
    if (a->av) fi_close(&a->av->fid);
    if (a->domain) fi_close(&a->domain->fid);
    if (a->fabric) fi_close(&a->fabric->fid);
    if (a->info) fi_freeinfo(a->info);
    free(a->buf); free(a->ctx); free(a);
}

struct atk *atk_open(const char *prov, size_t buflen) {
    struct atk *a = calloc(1, sizeof *a);
    struct fi_info *hints = fi_allocinfo();
    hints->caps = FI_RMA;  /* read and write, both ways */
    hints->mode = FI_CONTEXT | FI_CONTEXT2;
    hints->ep_attr->type = FI_EP_RDM;
    hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED |
                                  FI_MR_PROV_KEY | FI_MR_ENDPOINT;
    hints->fabric_attr->prov_name = strdup(prov);
    int rc = fi_getinfo(FI_VERSION(1, 17), "127.0.0.1", NULL, 0, hints, &a->info);
    fi_freeinfo(hints);
    if (rc) goto fail;
    if (fi_fabric(a->info->fabric_attr, &a->fabric, NULL)) goto fail;
    if (fi_domain(a->fabric, a->info, &a->domain, NULL)) goto fail;
    struct fi_cq_attr cq = { .size = 4096, .format = FI_CQ_FORMAT_DATA, .wait_obj = FI_WAIT_NONE };
    if (fi_cq_open(a->domain, &cq, &a->cq, NULL)) goto fail;
    struct fi_av_attr av = { .type = FI_AV_TABLE };
    if (fi_av_open(a->domain, &av, &a->av, NULL)) goto fail;
    if (fi_endpoint(a->domain, a->info, &a->ep, NULL)) goto fail;
    if (fi_ep_bind(a->ep, &a->av->fid, 0)) goto fail;
    if (fi_ep_bind(a->ep, &a->cq->fid, FI_TRANSMIT | FI_RECV)) goto fail;
    if (fi_enable(a->ep)) goto fail;
    a->buflen = buflen; a->buf = calloc(1, buflen);
    a->nctx = 4096; a->ctx = calloc(a->nctx, sizeof *a->ctx);
    if (fi_mr_reg(a->domain, a->buf, buflen, FI_READ | FI_WRITE, 0, 0x5eed, 0, &a->mr, NULL))
        goto fail;
    if (a->info->domain_attr->mr_mode & FI_MR_ENDPOINT) {
        if (fi_mr_bind(a->mr, &a->ep->fid, 0) || fi_mr_enable(a->mr)) goto fail;
    }
    return a;
fail:
    atk_close(a);
    return NULL;
}

char *atk_buf(struct atk *a) { return a->buf; }

int atk_peer(struct atk *a, const char *addr, size_t addrlen, uint64_t *out) {
    (void)addrlen;
    return fi_av_insert(a->av, addr, 1, (fi_addr_t *)out, 0, NULL) == 1 ? 0 : -1;
}

static long long now_ms(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000LL + t.tv_nsec / 1000000;
}

/* n operations of len bytes from the start of the attacker's buffer: op 0 fi_writedata (imm),
 * 1 fi_write, 2 fi_read into the buffer. errs[i]: 0 completed OK, a positive errno from the
 * completion error, negative: the post failed, -FI_ETIMEDOUT: no completion in time.
 * Returns how many completed OK. */
int atk_ops(struct atk *a, int op, uint64_t peer, size_t n, const uint64_t *raddr,
            const uint64_t *key, const uint64_t *imm, size_t len, int timeout_ms, int *errs) {
    size_t posted = 0, done = 0; int ok = 0;
    long long deadline = now_ms() + timeout_ms;
    void *desc = fi_mr_desc(a->mr);
    for (size_t i = 0; i < n; i++) errs[i] = -FI_ETIMEDOUT;
    while (done < n && now_ms() < deadline) {
        while (posted < n && posted - done < a->nctx) {
            void *ctx = &a->ctx[posted % a->nctx];
            ssize_t rc;
            if (op == 0)
                rc = fi_writedata(a->ep, a->buf, len, desc, imm[posted], peer, raddr[posted],
                                  key[posted], ctx);
            else if (op == 1)
                rc = fi_write(a->ep, a->buf, len, desc, peer, raddr[posted], key[posted], ctx);
            else
                rc = fi_read(a->ep, a->buf, len, desc, peer, raddr[posted], key[posted], ctx);
            if (rc == -FI_EAGAIN) break;
            if (rc < 0) { errs[posted] = (int)rc; posted++; done++; continue; }
            posted++;
        }
        struct fi_cq_data_entry e[64];
        ssize_t rc = fi_cq_read(a->cq, e, 64);
        if (rc > 0) {
            for (ssize_t i = 0; i < rc; i++) {
                size_t s = (size_t)((struct fi_context2 *)e[i].op_context - a->ctx);
                /* completions come back in order per peer on these providers; match by slot */
                for (size_t j = done; j < posted; j++)
                    if (j % a->nctx == s && errs[j] == -FI_ETIMEDOUT) { errs[j] = 0; ok++; break; }
                done++;
            }
        } else if (rc == -FI_EAVAIL) {
            struct fi_cq_err_entry err; memset(&err, 0, sizeof err);
            if (fi_cq_readerr(a->cq, &err, 0) > 0) {
                size_t s = (size_t)((struct fi_context2 *)err.op_context - a->ctx);
                for (size_t j = done; j < posted; j++)
                    if (j % a->nctx == s && errs[j] == -FI_ETIMEDOUT) {
                        errs[j] = err.err ? err.err : 1; break;
                    }
                done++;
            }
        }
    }
    return ok;
}
"""


def _module() -> Any:
    """Compile (once per source version, cached under the temp dir) and import the module."""
    import cffi

    tag = hashlib.sha256((CDEF + SOURCE + sys.version).encode()).hexdigest()[:12]
    name = f"_fabric_attacker_{tag}"
    where = Path(tempfile.gettempdir()) / f"disagg-attacker-{os.getuid()}"
    where.mkdir(exist_ok=True)
    built = list(where.glob(f"{name}*.so"))
    if not built:
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        ffi.set_source(name, SOURCE, libraries=["fabric"] if Path(
            "/usr/lib/x86_64-linux-gnu/libfabric.so").exists() else [],
            extra_link_args=[] if Path("/usr/lib/x86_64-linux-gnu/libfabric.so").exists()
            else ["-l:libfabric.so.1"], extra_compile_args=["-O1", "-w"])
        built = [Path(ffi.compile(tmpdir=str(where)))]
    spec = importlib.util.spec_from_file_location(name, built[0])
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


WRITEDATA, WRITE, READ = 0, 1, 2


class Attacker:
    """One raw libfabric endpoint. Every call returns per-operation results: 0 = the initiator
    saw it complete OK (which says nothing about what the target did with it)."""

    def __init__(self, provider: str = "tcp", buflen: int = 1 << 16) -> None:
        self._m = _module()
        self.ffi, self.lib = self._m.ffi, self._m.lib
        self._a = self.lib.atk_open(provider.split(";")[0].encode(), buflen)
        if self._a == self.ffi.NULL:
            raise RuntimeError(f"attacker: no {provider} endpoint")
        self.buflen = buflen

    def buffer(self) -> memoryview:
        return memoryview(self.ffi.buffer(self.lib.atk_buf(self._a), self.buflen))

    def peer(self, address: bytes) -> int:
        out = self.ffi.new("uint64_t *")
        if self.lib.atk_peer(self._a, address, len(address), out) != 0:
            raise RuntimeError("attacker: fi_av_insert failed")
        return int(out[0])

    def ops(self, op: int, peer: int, addrs: list[int], keys: list[int], imms: list[int] | None = None,
            length: int = 1, timeout_ms: int = 2000) -> list[int]:
        n = len(addrs)
        assert len(keys) == n and length <= self.buflen
        errs = self.ffi.new("int[]", n)
        self.lib.atk_ops(self._a, op, peer, n, self.ffi.new("uint64_t[]", addrs),
                         self.ffi.new("uint64_t[]", keys),
                         self.ffi.new("uint64_t[]", imms or [0] * n), length, timeout_ms, errs)
        return list(errs)

    def close(self) -> None:
        if self._a != self.ffi.NULL:
            self.lib.atk_close(self._a)
            self._a = self.ffi.NULL
