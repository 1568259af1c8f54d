/* SPDX-License-Identifier: MIT */
/* dsv4-openai: options, the listening socket (socket activation or --listen), signals. */
#include "build-config.h"

#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <netdb.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <syslog.h>
#include <unistd.h>

#include <systemd/sd-daemon.h>

#include "openai/http.h"
#include "openai/log.h"
#include "openai/server.h"

#define DEFAULT_LISTEN "127.0.0.1:8000"
/* Seconds a stopping server gives running requests to end after they are cancelled. */
#define STOP_GRACE_S 10u

void dsv4_oai_config_defaults(struct dsv4_oai_config *cfg)
{
    memset(cfg, 0, sizeof(*cfg));
    cfg->listen = DEFAULT_LISTEN;
    cfg->max_body = DSV4_OAI_DEFAULT_MAX_BODY;
    cfg->max_header = DSV4_OAI_DEFAULT_MAX_HEADER;
    cfg->request_timeout = DSV4_OAI_DEFAULT_REQUEST_TIMEOUT;
    cfg->idle_timeout = DSV4_OAI_DEFAULT_IDLE_TIMEOUT;
    cfg->max_connections = DSV4_OAI_DEFAULT_MAX_CONNECTIONS;
    cfg->max_generations = DSV4_OAI_DEFAULT_MAX_GENERATIONS;
    cfg->dsv4d_timeout_ms = DSV4_OAI_DEFAULT_DSV4D_TIMEOUT_MS;
}

static void usage(FILE *f)
{
    fprintf(f,
            "Usage: dsv4-openai [OPTION]...\n"
            "An OpenAI-compatible HTTP front for dsv4d: POST /v1/chat/completions, POST /v1/completions,\n"
            "GET /v1/models, GET /health, GET /metrics. Listens on the socket systemd passes (dsv4-openai.socket)\n"
            "or on --listen, and talks to dsv4d on its Unix socket.\n\n"
            "  --socket PATH            dsv4d's socket (default: $DSV4_SOCKET, else /run/dsv4d/dsv4d.sock)\n"
            "  --listen HOST:PORT       where to listen when not socket-activated (default %s)\n"
            "  --api-key-file FILE      require 'Authorization: Bearer KEY' with the key in FILE (its first line)\n"
            "  --model-name NAME        the model id to report (default: the name dsv4d reports)\n"
            "  --max-body BYTES         largest request body (default %u)\n"
            "  --max-header BYTES       largest request line and headers (default %u)\n"
            "  --request-timeout SEC    a whole request must arrive within this (default %u)\n"
            "  --idle-timeout SEC       close connections silent this long (default %u)\n"
            "  --max-connections N      open HTTP connections (default %u)\n"
            "  --max-generations N      completions in flight; more get 429 (default %u)\n"
            "  --dsv4d-timeout MS       longest wait for one answer from dsv4d (default %d)\n"
            "  -v, --verbose            log debug messages\n"
            "  -h, --help               this text\n"
            "      --version            the version\n",
            DEFAULT_LISTEN, DSV4_OAI_DEFAULT_MAX_BODY, DSV4_OAI_DEFAULT_MAX_HEADER, DSV4_OAI_DEFAULT_REQUEST_TIMEOUT,
            DSV4_OAI_DEFAULT_IDLE_TIMEOUT, DSV4_OAI_DEFAULT_MAX_CONNECTIONS, DSV4_OAI_DEFAULT_MAX_GENERATIONS,
            DSV4_OAI_DEFAULT_DSV4D_TIMEOUT_MS);
}

static int parse_uint(const char *opt, const char *s, unsigned long long lo, unsigned long long hi,
                      unsigned long long *ret)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-' || v < lo || v > hi) {
        fprintf(stderr, "dsv4-openai: %s '%s': must be a number in [%llu, %llu]\n", opt, s, lo, hi);
        return -EINVAL;
    }
    *ret = v;
    return 0;
}

/* Wipe and free the key: it is a secret, and a repeated --api-key-file replaces it. */
static void forget_key(struct dsv4_oai_config *cfg)
{
    if (cfg->api_key) {
        explicit_bzero(cfg->api_key, cfg->api_key_len);
        free(cfg->api_key);
        cfg->api_key = NULL;
        cfg->api_key_len = 0;
    }
}

static int read_key(const char *path, struct dsv4_oai_config *cfg)
{
    FILE *f = fopen(path, "re");
    char buf[DSV4_OAI_MAX_API_KEY + 2];
    if (!f) {
        fprintf(stderr, "dsv4-openai: --api-key-file %s: %s\n", path, strerror(errno));
        return -errno;
    }
    size_t n = fread(buf, 1, sizeof(buf) - 1, f);
    int err = ferror(f) ? errno : 0;
    fclose(f);
    if (err) {   /* a directory, an I/O error: say so, not that the key has the wrong length */
        fprintf(stderr, "dsv4-openai: --api-key-file %s: %s\n", path, strerror(err));
        return -err;
    }
    buf[n] = '\0';
    n = strcspn(buf, "\r\n");
    buf[n] = '\0';
    if (n == 0 || n > DSV4_OAI_MAX_API_KEY) {
        fprintf(stderr, "dsv4-openai: --api-key-file %s: the key (first line) must be 1 to %u bytes\n", path,
                DSV4_OAI_MAX_API_KEY);
        return -EINVAL;
    }
    forget_key(cfg);
    cfg->api_key = strdup(buf);
    cfg->api_key_len = n;
    explicit_bzero(buf, sizeof(buf));
    return cfg->api_key ? 0 : -ENOMEM;
}

static int listen_on(const char *spec)
{
    char host[256], port[32];
    const char *colon = strrchr(spec, ':');
    if (!colon || (size_t)(colon - spec) >= sizeof(host) || strlen(colon + 1) >= sizeof(port) || !colon[1]) {
        fprintf(stderr, "dsv4-openai: --listen '%s': expected HOST:PORT\n", spec);
        return -EINVAL;
    }
    size_t hl = (size_t)(colon - spec);
    memcpy(host, spec, hl);
    host[hl] = '\0';
    if (hl >= 2 && host[0] == '[' && host[hl - 1] == ']') {   /* [::1]:8000 */
        memmove(host, host + 1, hl - 2);
        host[hl - 2] = '\0';
    }
    snprintf(port, sizeof(port), "%s", colon + 1);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE}, *ai;
    int r = getaddrinfo(host[0] ? host : NULL, port, &hints, &ai);
    if (r) {
        fprintf(stderr, "dsv4-openai: --listen '%s': %s\n", spec, gai_strerror(r));
        return -EINVAL;
    }
    int fd = -1, err = 0;
    for (struct addrinfo *a = ai; a && fd < 0; a = a->ai_next) {
        fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
        if (fd < 0)
            continue;
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
        if (bind(fd, a->ai_addr, a->ai_addrlen) < 0 || listen(fd, SOMAXCONN) < 0) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(ai);
    if (fd < 0)
        fprintf(stderr, "dsv4-openai: --listen '%s': %s\n", spec, strerror(err ? err : EADDRNOTAVAIL));
    return fd < 0 ? -err : fd;
}

/* The socket from dsv4-openai.socket, or -ENOENT when not socket-activated. */
static int activated_socket(void)
{
    int n = sd_listen_fds(1);
    if (n <= 0)
        return n < 0 ? n : -ENOENT;
    if (n > 1 || sd_is_socket(SD_LISTEN_FDS_START, AF_UNSPEC, SOCK_STREAM, 1) <= 0) {
        fprintf(stderr, "dsv4-openai: expected exactly one listening stream socket from systemd, got %d fds\n", n);
        return -EINVAL;
    }
    int fd = SD_LISTEN_FDS_START;
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    return fd;
}

int main(int argc, char **argv)
{
    enum { OPT_SOCKET = 256, OPT_LISTEN, OPT_KEY, OPT_MODEL, OPT_BODY, OPT_HEADER, OPT_REQ_TIMEOUT, OPT_IDLE,
           OPT_CONNS, OPT_GENS, OPT_DSV4D_TIMEOUT, OPT_VERSION };
    static const struct option opts[] = {
        {"socket", required_argument, NULL, OPT_SOCKET},
        {"listen", required_argument, NULL, OPT_LISTEN},
        {"api-key-file", required_argument, NULL, OPT_KEY},
        {"model-name", required_argument, NULL, OPT_MODEL},
        {"max-body", required_argument, NULL, OPT_BODY},
        {"max-header", required_argument, NULL, OPT_HEADER},
        {"request-timeout", required_argument, NULL, OPT_REQ_TIMEOUT},
        {"idle-timeout", required_argument, NULL, OPT_IDLE},
        {"max-connections", required_argument, NULL, OPT_CONNS},
        {"max-generations", required_argument, NULL, OPT_GENS},
        {"dsv4d-timeout", required_argument, NULL, OPT_DSV4D_TIMEOUT},
        {"verbose", no_argument, NULL, 'v'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, OPT_VERSION},
        {NULL, 0, NULL, 0},
    };
    struct dsv4_oai_config cfg;
    unsigned long long v;
    int c;

    dsv4_oai_config_defaults(&cfg);
    while ((c = getopt_long(argc, argv, "vh", opts, NULL)) != -1) {
        switch (c) {
        case OPT_SOCKET: cfg.socket = optarg; break;
        case OPT_LISTEN: cfg.listen = optarg; break;
        case OPT_KEY:
            if (read_key(optarg, &cfg) < 0)
                return 1;
            break;
        case OPT_MODEL: cfg.model_name = optarg; break;
        case OPT_BODY:
            if (parse_uint("--max-body", optarg, 1024, 1ull << 30, &v) < 0) return 1;
            cfg.max_body = (size_t)v;
            break;
        case OPT_HEADER:
            if (parse_uint("--max-header", optarg, 4096, 1u << 20, &v) < 0) return 1;
            cfg.max_header = (size_t)v;
            break;
        case OPT_REQ_TIMEOUT:
            if (parse_uint("--request-timeout", optarg, 1, 86400, &v) < 0) return 1;
            cfg.request_timeout = (unsigned)v;
            break;
        case OPT_IDLE:
            if (parse_uint("--idle-timeout", optarg, 1, 86400, &v) < 0) return 1;
            cfg.idle_timeout = (unsigned)v;
            break;
        case OPT_CONNS:
            if (parse_uint("--max-connections", optarg, 1, 1u << 20, &v) < 0) return 1;
            cfg.max_connections = (unsigned)v;
            break;
        case OPT_GENS:
            if (parse_uint("--max-generations", optarg, 1, 4096, &v) < 0) return 1;
            cfg.max_generations = (unsigned)v;
            break;
        case OPT_DSV4D_TIMEOUT:
            if (parse_uint("--dsv4d-timeout", optarg, 1, INT_MAX, &v) < 0) return 1;
            cfg.dsv4d_timeout_ms = (int)v;
            break;
        case 'v': dsv4_oai_log_debug(true); break;
        case 'h': usage(stdout); return 0;
        case OPT_VERSION: printf("dsv4-openai %s\n", PACKAGE_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "dsv4-openai: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }

    /* Each connection is a descriptor: let the connection limit, not the soft fd limit, decide. */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    /* The signals are taken by sigwait() below; every thread started later inherits the mask. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
    signal(SIGPIPE, SIG_IGN);

    int fd = activated_socket();
    if (fd == -ENOENT)
        fd = listen_on(cfg.listen);
    if (fd < 0)
        return 1;

    struct dsv4_oai_server srv = {.cfg = &cfg};
    pthread_mutex_init(&srv.lock, NULL);
    pthread_cond_init(&srv.idle, NULL);
    if (dsv4_oai_http_start(&srv, fd) < 0)
        return 1;
    dsv4_oai_log(LOG_INFO, "dsv4-openai %s serving HTTP; dsv4d at %s%s", PACKAGE_VERSION,
                 cfg.socket ? cfg.socket : getenv("DSV4_SOCKET") && *getenv("DSV4_SOCKET") ? getenv("DSV4_SOCKET")
                                                                                      : "the default socket",
                 cfg.api_key ? "; API key required" : "");
    sd_notify(0, "READY=1\nSTATUS=serving");

    int sig;
    while (sigwait(&set, &sig) == 0 && sig == SIGHUP)
        ;   /* nothing to reload */
    dsv4_oai_log(LOG_INFO, "signal %d: stopping", sig);
    sd_notify(0, "STOPPING=1\nSTATUS=stopping");
    dsv4_oai_http_stop(&srv, STOP_GRACE_S);
    forget_key(&cfg);
    return 0;
}
