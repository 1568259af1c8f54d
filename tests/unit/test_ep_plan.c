/* SPDX-License-Identifier: MIT */
/* engine/model/ep_plan: the per-GPU memory plan with the routed experts split evenly, on V4-Flash and
 * V4-Pro at their published shapes (tools/dsv4-mkckpt's presets), and the exchange sizes.
 *
 * Weight bytes from those shapes, in the release format: routed experts FP4 (half a byte a value and
 * one UE8M0 scale byte per 32), dense linears FP8 (a byte a value, a scale byte per 128x128 block),
 * embeddings, head, router, compressors and the indexer's small projections BF16, mHC and norms f32.
 * Every layer is counted with an overlapping (CSA) compressor and an indexer, which over-counts the
 * sliding and HCA layers by a few MB each: the dense total is an upper bound (Flash about 9.4 GB,
 * the ~10 GB the design expects). The GPU is an H200 with 139 GiB free. */
#include "build-config.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/error.h"
#include "engine/model/ep_plan.h"

#define GIB (UINT64_C(1) << 30)
#define MIB (UINT64_C(1) << 20)
#define H200_FREE (139 * GIB)

struct shape {
    const char *name;
    int vocab, dim, layers, heads, head_dim, q_lora, o_groups, o_lora, experts, topk, inter;
    int index_heads, index_dim, hc;
};

/* tools/dsv4-mkckpt PRESETS, with its shared constants (head_dim 512, 64 indexer heads of 128, top-6, hc 4) */
static const struct shape FLASH = {"V4-Flash", 129280, 4096, 43, 64, 512, 1024, 8, 1024, 256, 6, 2048, 64, 128, 4};
static const struct shape PRO = {"V4-Pro", 129280, 7168, 61, 128, 512, 1536, 16, 1024, 384, 6, 3072, 64, 128, 4};

static uint64_t fp8(uint64_t out, uint64_t in)
{
    return out * in + ((out + 127) / 128) * ((in + 127) / 128);
}

static uint64_t bf16(uint64_t out, uint64_t in)
{
    return 2 * out * in;
}

static uint64_t expert_bytes(const struct shape *s)
{
    const uint64_t mat = (uint64_t)s->inter * s->dim;   /* w1, w3 [I, D]; w2 [D, I] */
    return 3 * (mat / 2 + mat / 32);
}

static uint64_t dense_bytes(const struct shape *s)
{
    const uint64_t D = s->dim, H = s->heads, hd = s->head_dim, hc = s->hc;
    uint64_t layer = fp8(s->q_lora, D) + fp8(H * hd, s->q_lora) + fp8(hd, D) +
                     fp8((uint64_t)s->o_groups * s->o_lora, H * hd / s->o_groups) +
                     fp8(D, (uint64_t)s->o_groups * s->o_lora);             /* attention */
    layer += 4 * (s->q_lora + hd + H);                                      /* q/kv norms, sinks */
    layer += 2 * bf16(2 * hd, D) + 4 * 4 * 2 * hd;                          /* compressor wkv, wgate, ape */
    layer += fp8((uint64_t)s->index_heads * s->index_dim, s->q_lora) + bf16(s->index_heads, D) +
             2 * bf16(2 * (uint64_t)s->index_dim, D);                       /* indexer */
    layer += 2 * fp8(s->inter, D) + fp8(D, s->inter);                       /* shared expert */
    layer += bf16(s->experts, D) + 4 * (uint64_t)s->experts;                /* router and its bias */
    layer += 2 * 4 * ((2 + hc) * hc * hc * D + (2 + hc) * hc + 3);         /* mHC, two sites */
    layer += 2 * 4 * D;                                                     /* norms */
    return (uint64_t)s->layers * layer + 2 * bf16(s->vocab, D) + 4 * (hc * hc * D + hc + 1 + D);
}

static struct dsv4_ep_plan_req request(const struct shape *s, int n_gpus, uint64_t *eb, uint64_t *free_b,
                                       int max_batch, uint64_t slot_bytes)
{
    for (int l = 0; l < s->layers; l++)
        eb[l] = expert_bytes(s);
    for (int g = 0; g < n_gpus; g++)
        free_b[g] = H200_FREE;
    return (struct dsv4_ep_plan_req){
        .n_gpus = n_gpus, .n_layers = s->layers, .n_experts = s->experts, .expert_bytes = eb,
        .dense_bytes = dense_bytes(s), .free_bytes = free_b, .max_batch = max_batch, .slot_bytes = slot_bytes,
        .gpu_fixed_bytes = 2 * GIB, .margin_bytes = GIB / 2,
    };
}

static void check_consistent(const struct dsv4_ep_plan_req *r, const struct dsv4_ep_plan *p)
{
    /* every rank reserves the largest group's slots, as the backend's ranks do */
    const int reserve = (r->max_batch + p->n_gpus - 1) / p->n_gpus;
    int next = 0;
    for (int g = 0; g < p->n_gpus; g++) {
        const struct dsv4_ep_gpu_plan *q = &p->gpu[g];
        assert_int_equal(q->e0, next);
        next = q->e1;
        assert_int_equal(q->slots, reserve);
        assert_true(q->experts == r->expert_bytes[0] * (uint64_t)(q->e1 - q->e0) * (uint64_t)r->n_layers);
        assert_true(q->caches == r->slot_bytes * (uint64_t)(q->slots + 1));
        assert_true(q->need == q->dense + q->experts + q->caches + q->fixed + q->margin);
        assert_true(q->dense == r->dense_bytes);
    }
    assert_int_equal(next, r->n_experts);
}

static void test_flash(void **state)
{
    uint64_t eb[DSV4_MAX_LAYERS], fb[DSV4_EP_MAX_GPUS];
    struct dsv4_ep_plan p;

    assert_true(expert_bytes(&FLASH) == 13369344);          /* 3 x 2048 x 4096 x 17/32 */
    assert_true(dense_bytes(&FLASH) > 8 * GIB && dense_bytes(&FLASH) < 10 * GIB);
    /* 64 slots of 256 MiB of caches (about a 64K-token FP8 slot), split over 2 H200s: fits */
    struct dsv4_ep_plan_req r = request(&FLASH, 2, eb, fb, 64, 256 * MIB);
    assert_int_equal(dsv4_ep_plan_make(&r, &p), 0);
    assert_true(p.fits);
    assert_int_equal(p.short_gpu, -1);
    check_consistent(&r, &p);
    assert_int_equal(p.gpu[0].e1 - p.gpu[0].e0, 128);
    assert_int_equal(p.gpu[1].slots, 32);
    assert_true(p.gpu[0].experts == UINT64_C(13369344) * 128 * 43);    /* 68.5 GiB */
    assert_int_equal(p.min_gpus, 2);
    printf("# %s on 2 H200s: each GPU %.1f GiB (dense %.1f, experts %.1f, caches %.1f) of %.0f free\n", FLASH.name,
           (double)p.gpu[0].need / GIB, (double)p.gpu[0].dense / GIB, (double)p.gpu[0].experts / GIB,
           (double)p.gpu[0].caches / GIB, (double)H200_FREE / GIB);

    /* the same on one: refused, with the numbers and the count that would hold it */
    r = request(&FLASH, 1, eb, fb, 64, 256 * MIB);
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -ENOMEM);
    assert_false(p.fits);
    assert_int_equal(p.short_gpu, 0);
    assert_true(p.short_bytes == p.gpu[0].need - H200_FREE);
    assert_int_equal(p.min_gpus, 2);
    const char *msg = dsv4_error_message();
    printf("# %s\n", msg);
    assert_non_null(strstr(msg, "experts split over 1 GPUs: GPU 0 has 139.00 GiB free"));
    assert_non_null(strstr(msg, "for experts 0..255 of each layer"));
    assert_non_null(strstr(msg, "for 64 slots"));
    assert_non_null(strstr(msg, "2 GPUs with 139.00 GiB free each would hold it"));

    /* a GPU with less free memory than the others is the one named */
    r = request(&FLASH, 4, eb, fb, 64, 256 * MIB);
    fb[2] = 20 * GIB;
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -ENOMEM);
    assert_int_equal(p.short_gpu, 2);
    assert_non_null(strstr(dsv4_error_message(), "GPU 2 has 20.00 GiB free"));
    assert_non_null(strstr(dsv4_error_message(), "experts 128..191"));
    assert_int_equal(p.min_gpus, 0);            /* no count of 20 GiB GPUs holds 9 GB of dense weights and caches */
    check_consistent(&r, &p);
}

static void test_pro(void **state)
{
    uint64_t eb[DSV4_MAX_LAYERS], fb[DSV4_EP_MAX_GPUS];
    struct dsv4_ep_plan p;

    assert_true(expert_bytes(&PRO) == 35094528);            /* 3 x 3072 x 7168 x 17/32 */
    struct dsv4_ep_plan_req r = request(&PRO, 8, eb, fb, 32, 512 * MIB);
    assert_int_equal(dsv4_ep_plan_make(&r, &p), 0);
    check_consistent(&r, &p);
    assert_int_equal(p.gpu[7].e0, 336);
    assert_int_equal(p.gpu[7].e1, 384);
    assert_int_equal(p.gpu[3].slots, 4);
    assert_int_equal(p.min_gpus, 8);
    printf("# %s on 8 H200s: each GPU %.1f GiB (dense %.1f, experts %.1f, caches %.1f) of %.0f free\n", PRO.name,
           (double)p.gpu[0].need / GIB, (double)p.gpu[0].dense / GIB, (double)p.gpu[0].experts / GIB,
           (double)p.gpu[0].caches / GIB, (double)H200_FREE / GIB);

    /* on 7 the first ranks take 55 experts a layer: refused, 8 named */
    r = request(&PRO, 7, eb, fb, 32, 512 * MIB);
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -ENOMEM);
    assert_int_equal(p.gpu[0].e1 - p.gpu[0].e0, 55);
    assert_int_equal(p.gpu[6].e1 - p.gpu[6].e0, 54);
    assert_int_equal(p.short_gpu, 0);
    assert_int_equal(p.min_gpus, 8);
    printf("# %s\n", dsv4_error_message());
    assert_non_null(strstr(dsv4_error_message(), "8 GPUs with 139.00 GiB free each would hold it"));
    check_consistent(&r, &p);

    /* 4 slots: no more than 4 GPUs can take part, and 4 do not hold it, so no count is named */
    r = request(&PRO, 4, eb, fb, 4, 512 * MIB);
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -ENOMEM);
    assert_int_equal(p.min_gpus, 0);
    assert_null(strstr(dsv4_error_message(), "would hold it"));
    check_consistent(&r, &p);
}

static void test_bad_requests(void **state)
{
    uint64_t eb[DSV4_MAX_LAYERS], fb[DSV4_EP_MAX_GPUS];
    struct dsv4_ep_plan p;
    struct dsv4_ep_plan_req r = request(&FLASH, 2, eb, fb, 64, 256 * MIB);

    r.n_gpus = 0;
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -EINVAL);
    r.n_gpus = DSV4_EP_MAX_GPUS + 1;
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "1..16 are supported"));
    r.n_gpus = 2;
    r.n_experts = 1;
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "the model has 1 experts a layer"));
    r.n_experts = 256;
    r.max_batch = 0;
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -EINVAL);
    r.max_batch = 1;                                /* a GPU without slots: refused */
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "each GPU holds a group of the slots"));
    r.max_batch = 64;
    eb[5] = UINT64_C(1) << 60;
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -EINVAL);
    assert_non_null(strstr(dsv4_error_message(), "layer 5's experts"));
    eb[5] = expert_bytes(&FLASH);
    r.free_bytes = NULL;
    assert_int_equal(dsv4_ep_plan_make(&r, &p), -EINVAL);
}

static void test_slots(void **state)
{
    assert_int_equal(dsv4_ep_slots(64, 8, 0), 8);
    assert_int_equal(dsv4_ep_slots(10, 4, 0), 3);
    assert_int_equal(dsv4_ep_slots(10, 4, 1), 3);
    assert_int_equal(dsv4_ep_slots(10, 4, 2), 2);
    assert_int_equal(dsv4_ep_slots(1, 2, 1), 0);
}

/* The smallest power-of-two bucket holding ceil(batch / n) rows: what every rank runs in lockstep. */
static int bucket_of(int batch, int n)
{
    int rows = (batch + n - 1) / n, b = 1;
    while (b < rows)
        b *= 2;
    return b;
}

static void test_exchange(void **state)
{
    struct dsv4_config c = {.dim = FLASH.dim, .n_layers = FLASH.layers, .n_experts_per_tok = FLASH.topk};
    struct dsv4_ep_exchange x;

    /* fp8: 4096 e4m3 + 32 scales + 6 ids; 6 pair outputs of 4096 f32 */
    assert_int_equal(dsv4_ep_exchange_bytes(&c, 2, 8, true, &x), 0);
    assert_true(x.gather_row == 4152);
    assert_true(x.return_row == 98304);
    assert_true(x.gather_bytes == 8 * 4152);
    assert_true(x.return_bytes == 8 * 98304);
    assert_true(x.step_bytes == UINT64_C(35244864));         /* (33216 + 786432) x 43 */
    assert_int_equal(dsv4_ep_exchange_bytes(&c, 8, 4, false, &x), 0);
    assert_true(x.gather_row == 4 * 4096 + 24);
    assert_true(x.gather_bytes == 7 * 4 * x.gather_row);
    assert_true(x.return_bytes == 7 * 4 * x.return_row);
    assert_int_equal(dsv4_ep_exchange_bytes(&c, 1, 64, true, &x), 0);
    assert_true(x.step_bytes == 0);                          /* one GPU exchanges nothing */
    assert_int_equal(dsv4_ep_exchange_bytes(&c, 0, 1, true, &x), -EINVAL);
    assert_int_equal(dsv4_ep_exchange_bytes(&c, 2, 0, true, &x), -EINVAL);

    /* doc/MULTIGPU.md's table, fp8 */
    static const int batch[] = {1, 16, 64}, gpus[] = {2, 4, 8};
    for (int i = 0; i < 3; i++)
        for (int j = 0; j < 3; j++) {
            const int b = bucket_of(batch[i], gpus[j]);
            assert_int_equal(dsv4_ep_exchange_bytes(&c, gpus[j], b, true, &x), 0);
            printf("# Flash batch %2d on %d GPUs: bucket %2d, per layer into each GPU %7llu + %7llu bytes, "
                   "per step %9llu\n", batch[i], gpus[j], b, (unsigned long long)x.gather_bytes,
                   (unsigned long long)x.return_bytes, (unsigned long long)x.step_bytes);
        }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flash),
        cmocka_unit_test(test_pro),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_slots),
        cmocka_unit_test(test_exchange),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
