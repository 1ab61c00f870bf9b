/*
 * The tile unit (AMX) for the whole library: the process's permission to use it, and
 * each thread's loaded tile shapes (the matmul's in linear.c, the attention's in
 * tiled_attention.c), loaded only when they change and released after each call.
 */
#define _GNU_SOURCE /* syscall() under -std=c11 */
#include "kernels.h"

#if ZS_AMX
#include <sys/syscall.h>
#include <unistd.h>

/* Whether this process may use the tile registers (Linux asks each process to request
 * them once; oneDNN makes the same request). */
int zs_amx_ready(void) {
    static int ready = -1;
    if (ready < 0) {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        ready = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    }
    return ready;
}

__thread int zs_amx_shape; /* this thread's loaded shape (0: none) */

void zs_amx_load(int shape, const uint8_t rows[8]) {
    if (zs_amx_shape == shape) return;
    struct {
        uint8_t palette, start;
        uint8_t reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } __attribute__((packed)) cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = rows[t] ? 64 : 0;
        cfg.rows[t] = rows[t];
    }
    /* GCC does not count ldtilecfg as reading all 64 bytes and drops the stores above
     * when this is not inlined: make them happen. */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
    zs_amx_shape = shape;
}

void zs_amx_release(void) {
    if (zs_amx_shape) { /* tiles in use cost each of this thread's context switches 8 KB */
        _tile_release();
        zs_amx_shape = 0;
    }
}
#endif
