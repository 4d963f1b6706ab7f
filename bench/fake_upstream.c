/* A fast fake vLLM upstream for the benchmark: one thread, epoll, keep-alive.
 *
 *   fake_upstream PORT
 *
 * POST /v1/chat/completions; the answer is chosen by the model name in the body (the proxy
 * forwards it):
 *   bench-json       a canned vLLM-shaped chat.completion (also when "stream":true is absent)
 *   bench-coalesced  a 100-delta vLLM-shaped SSE stream in one write
 *   bench-chunked    the same stream, one chunk per write, GAP_US apart (env FAKE_GAP_US, default 200)
 *   bench-hold       the same stream, one chunk every HOLD_MS (env FAKE_HOLD_MS, default 100) - held streams
 * POST /v1/completions, /v1/embeddings, /v1/messages (the pass-through endpoints), vLLM 0.32's shapes:
 *   a text_completion (JSON, or a 100-chunk stream + usage chunk + [DONE] in one write, with
 *   "stream":true), an embeddings list (one 384-float vector + usage), an Anthropic Message (JSON, or
 *   message_start .. 100 text_delta .. message_delta + message_stop in one write, with "stream":true).
 * GET /v1/models lists those four (vLLM-shaped, max_model_len 32768); any other GET (/health) is a 200.
 * Anything else gets bench-json (or bench-coalesced when the body asks "stream":true).
 * Streams use chunked transfer-encoding, as vLLM (uvicorn) does.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define NDELTAS 100
#define MAXEV 256

enum { M_JSON, M_COALESCED, M_CHUNKED, M_HOLD };
enum { P_CHAT, P_COMPLETIONS, P_EMBEDDINGS, P_MESSAGES, NPATHS };

typedef struct conn {
    int fd;
    char *in; size_t in_len, in_cap;
    char *out; size_t out_len, out_off, out_cap;
    int streaming;      /* index of the next event to send, -1 = none */
    int mode;
    long long next_at;  /* monotonic us */
    struct conn *next_timer, *prev_timer;
    int in_timer;
} conn;

static const char models_json[] =
    "{\"object\":\"list\",\"data\":["
    "{\"id\":\"bench-json\",\"object\":\"model\",\"created\":1795979497,\"owned_by\":\"vllm\",\"max_model_len\":32768},"
    "{\"id\":\"bench-coalesced\",\"object\":\"model\",\"created\":1795979497,\"owned_by\":\"vllm\",\"max_model_len\":32768},"
    "{\"id\":\"bench-chunked\",\"object\":\"model\",\"created\":1795979497,\"owned_by\":\"vllm\",\"max_model_len\":32768},"
    "{\"id\":\"bench-hold\",\"object\":\"model\",\"created\":1795979497,\"owned_by\":\"vllm\",\"max_model_len\":32768}]}";
static char json_resp[4096]; static size_t json_len;
static char *events[NDELTAS + 4]; static size_t event_len[NDELTAS + 4]; static int nevents;
static char *coalesced; static size_t coalesced_len;
static const char stream_head[] = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                                  "transfer-encoding: chunked\r\n\r\n";
/* the other paths' answers, whole (headers included): [path][0] JSON, [path][1] coalesced stream */
static char *edge_resp[NPATHS][2]; static size_t edge_len[NPATHS][2];
static long long gap_us = 200, hold_us = 100000;
static conn *timers;  /* unsorted list of streaming conns waiting for their next event */
static int epfd;

static long long now_us(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000LL + ts.tv_nsec / 1000;
}

static void append(conn *c, const char *p, size_t n) {
    if (c->out_len + n > c->out_cap) {
        size_t cap = c->out_cap ? c->out_cap : 4096;
        while (cap < c->out_len + n) cap *= 2;
        c->out = realloc(c->out, cap); c->out_cap = cap;
    }
    memcpy(c->out + c->out_len, p, n); c->out_len += n;
}

static void build(void) {
    const char *id = "chatcmpl-b4a531b0b4c6574e";
    json_len = snprintf(json_resp, sizeof json_resp,
        "{\"id\":\"%s\",\"object\":\"chat.completion\",\"created\":1795979497,\"model\":\"bench-json\","
        "\"choices\":[{\"index\":0,\"message\":{\"role\":\"assistant\",\"content\":\"15</think>ust36\\\"\\\"Example these once\\\"\","
        "\"refusal\":null,\"annotations\":null,\"audio\":null,\"function_call\":null,\"reasoning\":null},\"logprobs\":null,"
        "\"finish_reason\":\"stop\",\"stop_reason\":null,\"token_ids\":null,\"routed_experts\":null}],\"service_tier\":null,"
        "\"system_fingerprint\":\"vllm-0.32.0-ada4ea05\",\"usage\":{\"prompt_tokens\":28,\"total_tokens\":39,\"completion_tokens\":11,"
        "\"prompt_tokens_details\":null,\"completion_tokens_details\":null},\"prompt_logprobs\":null,\"prompt_token_ids\":null,"
        "\"prompt_text\":null,\"kv_transfer_params\":null,\"ec_transfer_params\":null,\"metrics\":null}", id);
    char body[2048];
    static const char *words[] = {" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."};
    for (int i = 0; i < NDELTAS + 3; i++) {
        int n;
        if (i == 0)
            n = snprintf(body, sizeof body, "data: {\"id\":\"%s\",\"object\":\"chat.completion.chunk\",\"created\":1795979497,"
                "\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,"
                "\"finish_reason\":null}],\"prompt_token_ids\":null,\"prompt_text\":null}\n\n", id);
        else if (i <= NDELTAS)
            n = snprintf(body, sizeof body, "data: {\"id\":\"%s\",\"object\":\"chat.completion.chunk\",\"created\":1795979497,"
                "\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"%s\"},\"logprobs\":null,"
                "\"finish_reason\":%s,\"token_ids\":null}]}\n\n", id, words[(i - 1) % 10], i == NDELTAS ? "\"stop\"" : "null");
        else if (i == NDELTAS + 1)
            n = snprintf(body, sizeof body, "data: {\"id\":\"%s\",\"object\":\"chat.completion.chunk\",\"created\":1795979497,"
                "\"model\":\"bench\",\"choices\":[],\"usage\":{\"prompt_tokens\":28,\"total_tokens\":128,\"completion_tokens\":100,"
                "\"prompt_tokens_details\":null,\"completion_tokens_details\":null}}\n\ndata: [DONE]\n\n", id);
        else
            n = 0;
        char frame[2200];
        size_t fl;
        if (n) fl = snprintf(frame, sizeof frame, "%x\r\n%s\r\n", n, body);
        else fl = snprintf(frame, sizeof frame, "0\r\n\r\n");
        events[i] = malloc(fl); memcpy(events[i], frame, fl); event_len[i] = fl;
    }
    nevents = NDELTAS + 3;
    coalesced_len = strlen(stream_head);
    for (int i = 0; i < nevents; i++) coalesced_len += event_len[i];
    coalesced = malloc(coalesced_len);
    size_t off = strlen(stream_head); memcpy(coalesced, stream_head, off);
    for (int i = 0; i < nevents; i++) { memcpy(coalesced + off, events[i], event_len[i]); off += event_len[i]; }
}


/* A body as an HTTP answer with content-length. */
static void whole_json(int path, const char *body) {
    size_t n = strlen(body);
    char *r = malloc(n + 256);
    int h = snprintf(r, 256, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n\r\n", n);
    memcpy(r + h, body, n);
    edge_resp[path][0] = r; edge_len[path][0] = h + n;
}

/* Events (each one chunk of the chunked encoding) after the stream's headers, the last chunk after them. */
static char *sbuf; static size_t slen, scap;
static void sput(const char *p, size_t n) {
    if (slen + n > scap) { scap = (slen + n) * 2; sbuf = realloc(sbuf, scap); }
    memcpy(sbuf + slen, p, n); slen += n;
}
static void schunk(const char *event) {
    char frame[4096];
    int fl = snprintf(frame, sizeof frame, "%zx\r\n%s\r\n", strlen(event), event);
    sput(frame, fl);
}
static void send_stream(int path) {
    sput("0\r\n\r\n", 5);
    edge_resp[path][1] = sbuf; edge_len[path][1] = slen;
    sbuf = NULL; slen = scap = 0;
}

static void build_edge(void) {
    static const char *words[] = {" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", "."};
    char ev[2048];
    /* /v1/completions (completions_legacy's shape) */
    whole_json(P_COMPLETIONS, "{\"id\":\"cmpl-8e3b6dfa177142ca\",\"object\":\"text_completion\",\"created\":1795980464,"
        "\"model\":\"bench-json\",\"choices\":[{\"index\":0,\"text\":\"ast small],}With 859de,}\",\"logprobs\":null,"
        "\"finish_reason\":\"length\",\"stop_reason\":null,\"token_ids\":null,\"prompt_logprobs\":null,\"prompt_token_ids\":null,"
        "\"routed_experts\":null}],\"service_tier\":null,\"system_fingerprint\":\"vllm-0.32.0-3b2c4fe5\",\"usage\":{"
        "\"prompt_tokens\":5,\"total_tokens\":15,\"completion_tokens\":10,\"prompt_tokens_details\":{\"cached_tokens\":0,"
        "\"created_cache_tokens\":null,\"multimodal_tokens\":null},\"completion_tokens_details\":null},\"kv_transfer_params\":null,"
        "\"ec_transfer_params\":null,\"metrics\":null}");
    sput(stream_head, sizeof stream_head - 1);
    for (int i = 1; i <= NDELTAS; i++) {
        snprintf(ev, sizeof ev, "data: {\"id\":\"cmpl-8e3b6dfa177142ca\",\"object\":\"text_completion\",\"created\":1795980464,"
                 "\"model\":\"bench\",\"choices\":[{\"index\":0,\"text\":\"%s\",\"logprobs\":null,\"finish_reason\":%s,"
                 "\"stop_reason\":null}]}\n\n", words[(i - 1) % 10], i == NDELTAS ? "\"length\"" : "null");
        schunk(ev);
    }
    schunk("data: {\"id\":\"cmpl-8e3b6dfa177142ca\",\"object\":\"text_completion\",\"created\":1795980464,\"model\":\"bench\","
           "\"choices\":[],\"usage\":{\"prompt_tokens\":28,\"total_tokens\":128,\"completion_tokens\":100}}\n\ndata: [DONE]\n\n");
    send_stream(P_COMPLETIONS);
    /* /v1/embeddings: one 384-dimension vector (a small sentence embedder's size) */
    size_t cap = 16384; char *emb = malloc(cap); size_t n = 0;
    n += snprintf(emb + n, cap - n, "{\"id\":\"embd-9613b3fea116b5f6\",\"object\":\"list\",\"created\":1796216226,"
                  "\"model\":\"bench-json\",\"data\":[{\"index\":0,\"object\":\"embedding\",\"embedding\":[");
    for (int i = 0; i < 384; i++)
        n += snprintf(emb + n, cap - n, "%s%.17g", i ? "," : "", ((i * 7919) % 2000 - 1000) / 4096.0 + 1e-9 * i);
    snprintf(emb + n, cap - n, "]}],\"usage\":{\"prompt_tokens\":9,\"total_tokens\":9,\"completion_tokens\":0,"
             "\"prompt_tokens_details\":null}}");
    whole_json(P_EMBEDDINGS, emb);
    free(emb);
    /* /v1/messages (anthropic_messages[_stream]'s shapes) */
    whole_json(P_MESSAGES, "{\"id\":\"chatcmpl-9e2df3b98490b5c7\",\"type\":\"message\",\"role\":\"assistant\",\"content\":["
        "{\"type\":\"text\",\"text\":\"The quick brown fox jumps over a lazy dog.\"}],\"model\":\"bench-json\",\"stop_reason\":\"end_turn\","
        "\"usage\":{\"input_tokens\":24,\"output_tokens\":10,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":0}}");
    sput(stream_head, sizeof stream_head - 1);
    schunk("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"chatcmpl-a4e179f194ff9e0a\","
           "\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"bench\",\"stop_reason\":null,"
           "\"stop_sequence\":null,\"usage\":{\"input_tokens\":24,\"output_tokens\":0}}}\n\n");
    schunk("event: content_block_start\ndata: {\"type\":\"content_block_start\",\"content_block\":{\"type\":\"text\","
           "\"text\":\"\"},\"index\":0}\n\n");
    for (int i = 1; i <= NDELTAS; i++) {
        snprintf(ev, sizeof ev, "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{"
                 "\"type\":\"text_delta\",\"text\":\"%s\"},\"index\":0}\n\n", words[(i - 1) % 10]);
        schunk(ev);
    }
    schunk("event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n");
    schunk("event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\","
           "\"stop_sequence\":null},\"usage\":{\"input_tokens\":24,\"output_tokens\":100,\"cache_creation_input_tokens\":0,"
           "\"cache_read_input_tokens\":0}}\n\n");
    schunk("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
    send_stream(P_MESSAGES);
}

static void timer_add(conn *c) {
    if (c->in_timer) return;
    c->in_timer = 1; c->prev_timer = NULL; c->next_timer = timers;
    if (timers) timers->prev_timer = c;
    timers = c;
}
static void timer_del(conn *c) {
    if (!c->in_timer) return;
    c->in_timer = 0;
    if (c->prev_timer) c->prev_timer->next_timer = c->next_timer; else timers = c->next_timer;
    if (c->next_timer) c->next_timer->prev_timer = c->prev_timer;
}

static void close_conn(conn *c) {
    timer_del(c);
    close(c->fd);
    free(c->in); free(c->out); free(c);
}

static int flush_out(conn *c) {  /* 0 ok, -1 closed */
    while (c->out_off < c->out_len) {
        ssize_t w = write(c->fd, c->out + c->out_off, c->out_len - c->out_off);
        if (w < 0) {
            if (errno == EAGAIN) break;
            return -1;
        }
        c->out_off += w;
    }
    if (c->out_off == c->out_len) c->out_off = c->out_len = 0;
    struct epoll_event ev = {.events = EPOLLIN | (c->out_len ? EPOLLOUT : 0), .data.ptr = c};
    epoll_ctl(epfd, EPOLL_CTL_MOD, c->fd, &ev);
    return 0;
}

static char *find_ci(char *hay, size_t n, const char *needle) {
    size_t m = strlen(needle);
    for (size_t i = 0; i + m <= n; i++) if (!strncasecmp(hay + i, needle, m)) return hay + i;
    return NULL;
}

/* Parse as many complete requests as are buffered; queue their answers. */
static void handle_input(conn *c) {
    for (;;) {
        if (c->streaming >= 0) return;  /* one stream at a time per connection */
        char *end = memmem(c->in, c->in_len, "\r\n\r\n", 4);
        if (!end) return;
        size_t head = end - c->in + 4, clen = 0;
        char *cl = find_ci(c->in, head, "\r\ncontent-length:");
        if (cl) clen = strtoul(cl + 17, NULL, 10);
        if (c->in_len < head + clen) return;
        char *body = c->in + head;
        if (!strncmp(c->in, "GET ", 4)) {  /* discovery and health checks */
            char hdr[256];
            int models = !strncmp(c->in + 4, "/v1/models", 10);
            const char *b = models ? models_json : "";
            int n = snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             "server: uvicorn\r\ncontent-length: %zu\r\n\r\n", strlen(b));
            append(c, hdr, n); append(c, b, strlen(b));
            memmove(c->in, c->in + head + clen, c->in_len - head - clen);
            c->in_len -= head + clen;
            continue;
        }
        int path = P_CHAT;
        if (!strncmp(c->in, "POST /v1/completions ", 21)) path = P_COMPLETIONS;
        else if (!strncmp(c->in, "POST /v1/embeddings ", 20)) path = P_EMBEDDINGS;
        else if (!strncmp(c->in, "POST /v1/messages ", 18)) path = P_MESSAGES;
        if (path != P_CHAT) {
            int stream = path != P_EMBEDDINGS && (memmem(body, clen, "\"stream\":true", 13) ||
                                                  memmem(body, clen, "\"stream\": true", 14));
            append(c, edge_resp[path][stream], edge_len[path][stream]);
            memmove(c->in, c->in + head + clen, c->in_len - head - clen);
            c->in_len -= head + clen;
            continue;
        }
        int mode = M_JSON;
        if (memmem(body, clen, "bench-chunked", 13)) mode = M_CHUNKED;
        else if (memmem(body, clen, "bench-hold", 10)) mode = M_HOLD;
        else if (memmem(body, clen, "bench-coalesced", 15)) mode = M_COALESCED;
        else if (memmem(body, clen, "bench-json", 10)) mode = M_JSON;
        else if (memmem(body, clen, "\"stream\":true", 13) || memmem(body, clen, "\"stream\": true", 14)) mode = M_COALESCED;
        if (mode == M_JSON) {
            char hdr[256];
            int n = snprintf(hdr, sizeof hdr, "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %zu\r\n\r\n", json_len);
            append(c, hdr, n); append(c, json_resp, json_len);
        } else if (mode == M_COALESCED) {
            append(c, coalesced, coalesced_len);
        } else {
            append(c, stream_head, sizeof stream_head - 1);
            append(c, events[0], event_len[0]);
            c->streaming = 1; c->mode = mode;
            c->next_at = now_us() + (mode == M_HOLD ? hold_us : gap_us);
            timer_add(c);
        }
        memmove(c->in, c->in + head + clen, c->in_len - head - clen);
        c->in_len -= head + clen;
    }
}

int main(int argc, char **argv) {
    int port = argc > 1 ? atoi(argv[1]) : 8199;
    if (getenv("FAKE_GAP_US")) gap_us = atoll(getenv("FAKE_GAP_US"));
    if (getenv("FAKE_HOLD_MS")) hold_us = atoll(getenv("FAKE_HOLD_MS")) * 1000;
    signal(SIGPIPE, SIG_IGN);
    struct rlimit rl; getrlimit(RLIMIT_NOFILE, &rl); rl.rlim_cur = rl.rlim_max; setrlimit(RLIMIT_NOFILE, &rl);
    build();
    build_edge();
    int ls = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (bind(ls, (void *)&a, sizeof a) || listen(ls, 4096)) { perror("bind/listen"); return 1; }
    epfd = epoll_create1(0);
    struct epoll_event lev = {.events = EPOLLIN, .data.ptr = NULL};
    epoll_ctl(epfd, EPOLL_CTL_ADD, ls, &lev);
    printf("fake upstream listening on 127.0.0.1:%d\n", port); fflush(stdout);
    struct epoll_event evs[MAXEV];
    for (;;) {
        int timeout = -1;
        long long now = now_us();
        if (timers) {
            long long soon = timers->next_at;
            for (conn *t = timers; t; t = t->next_timer) if (t->next_at < soon) soon = t->next_at;
            timeout = soon <= now ? 0 : (int)((soon - now + 999) / 1000);
        }
        int n = epoll_wait(epfd, evs, MAXEV, timeout);
        for (int i = 0; i < n; i++) {
            conn *c = evs[i].data.ptr;
            if (!c) {
                for (;;) {
                    int fd = accept4(ls, NULL, NULL, SOCK_NONBLOCK);
                    if (fd < 0) break;
                    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                    conn *nc = calloc(1, sizeof *nc);
                    nc->fd = fd; nc->streaming = -1;
                    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = nc};
                    epoll_ctl(epfd, EPOLL_CTL_ADD, fd, &ev);
                }
                continue;
            }
            if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) {
                int closed = 0;
                for (;;) {
                    if (c->in_cap - c->in_len < 16384) { c->in_cap = c->in_cap ? c->in_cap * 2 : 65536; c->in = realloc(c->in, c->in_cap); }
                    ssize_t r = read(c->fd, c->in + c->in_len, c->in_cap - c->in_len);
                    if (r > 0) { c->in_len += r; continue; }
                    if (r == 0 || errno != EAGAIN) closed = 1;
                    break;
                }
                if (closed) { close_conn(c); continue; }
                handle_input(c);
            }
            if (flush_out(c) < 0) { close_conn(c); continue; }
        }
        now = now_us();
        for (conn *t = timers, *nx; t; t = nx) {
            nx = t->next_timer;
            if (t->next_at > now) continue;
            if (t->out_len == 0) {  /* don't queue past a slow reader: backpressure */
                append(t, events[t->streaming], event_len[t->streaming]);
                t->streaming++;
            }
            t->next_at = now + (t->mode == M_HOLD ? hold_us : gap_us);
            if (t->streaming >= nevents) { t->streaming = -1; timer_del(t); }
            if (flush_out(t) < 0) { close_conn(t); continue; }
            if (t->streaming < 0) handle_input(t), flush_out(t);
        }
    }
}
