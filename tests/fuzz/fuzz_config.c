/* SPDX-License-Identifier: MIT */
/* libFuzzer target for config.json parsing (engine/model/config.c): both spellings (transformers' and
 * DeepSeek's inference config). The input is the file's text. A config that parses must hold what
 * the loader and the backends divide and index by: positive sizes, layers within DSV4_MAX_LAYERS,
 * rotary dims even and within the head, rotary bases above 1, experts per token within the experts,
 * o_groups dividing the heads. */
#include "build-config.h"

#include <stdlib.h>
#include <string.h>

#include "engine/model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    char *text = malloc(size + 1);
    struct dsv4_config c;

    if (!text)
        return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    if (dsv4_config_parse(text, "config.json", &c) == 0) {
        if (c.n_layers <= 0 || c.n_layers > DSV4_MAX_LAYERS || c.dim <= 0 || c.vocab_size <= 0 ||
            c.n_heads <= 0 || c.head_dim <= 0 || c.rope_dim <= 0 || c.rope_dim > c.head_dim || c.rope_dim % 2 ||
            !(c.rope_main.theta > 1.0) || !(c.rope_compress.theta > 1.0) || c.o_groups <= 0 ||
            c.n_heads % c.o_groups || c.n_experts_per_tok > c.n_experts)
            abort();
    }
    free(text);
    return 0;
}
