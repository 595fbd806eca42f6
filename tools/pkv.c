/* pkv.c: the command-line tool's entry point: dispatches to bench, sim, run and route. */
#include "tool.h"

#include <stdio.h>
#include <string.h>

static void usage(FILE *f) {
    fprintf(f,
            "pkv %s - paged KV cache and paged attention for LLM inference\n"
            "\n"
            "usage: pkv <command> [options]\n"
            "\n"
            "commands:\n"
            "  sim            serving replay: paged + prefix caching vs paged vs contiguous\n"
            "                 (built-in seeded workload; `pkv sim --help`)\n"
            "  run MODEL      generate with a llama2.c checkpoint over the paged cache\n"
            "  route          KV-aware routing across replicas from prefix-index events, against\n"
            "                 round robin (`pkv route --help`)\n"
            "  bench ops      median ns of cache operations (append, fork, truncate, ...)\n"
            "  bench attn     paged attention against contiguous and the memory bandwidth\n"
            "  bench prefix   prefix-match cost per token, hit and miss; what recording events costs\n"
            "  bench tier     moving a prompt's blocks to and from storage tiers (host, files, Redis),\n"
            "                 prefetch and write-back included\n"
            "  bench tree     a speculative draft tree verified by tree attention, against its paths\n"
            "                 prefilled one by one and against one prefill of as many queries\n"
            "  bench share    decode of forks with their shared prefix read once, against a read a fork\n"
            "  bench mla      decode over a cache whose V lives in K (MLA, DeepSeek's shape), against V\n"
            "                 stored apart\n"
            "  bench shift    a context shift (pkv_seq_shift) against a copy of the bytes it moves\n"
            "  version        print the library version\n"
            "\n"
            "Each command takes --help. Exit status: 0 ok, 1 usage error, 2 runtime error.\n",
            pkv_version());
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return TOOL_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        usage(stdout);
        return TOOL_OK;
    }
    if (!strcmp(cmd, "version") || !strcmp(cmd, "--version")) {
        printf("pkv %s\n", pkv_version());
        return TOOL_OK;
    }
    if (!strcmp(cmd, "sim")) return tool_sim(argc - 1, argv + 1);
    if (!strcmp(cmd, "run")) return tool_run(argc - 1, argv + 1);
    if (!strcmp(cmd, "route")) return tool_route(argc - 1, argv + 1);
    if (!strcmp(cmd, "bench")) {
        static const char bench_usage[] = "usage: pkv bench ops|attn|prefix|tier|tree|share|mla|shift [options]  (`pkv bench attn --help`, ...)\n";
        if (argc < 3) {
            fprintf(stderr, "pkv bench: which benchmark? ops, attn, prefix, tier, tree, share, mla or shift\n%s", bench_usage);
            return TOOL_USAGE;
        }
        const char *what = argv[2];
        if (!strcmp(what, "-h") || !strcmp(what, "--help")) {
            fputs(bench_usage, stdout);
            return TOOL_OK;
        }
        if (!strcmp(what, "ops")) return tool_bench_ops(argc - 2, argv + 2);
        if (!strcmp(what, "attn")) return tool_bench_attn(argc - 2, argv + 2);
        if (!strcmp(what, "prefix")) return tool_bench_prefix(argc - 2, argv + 2);
        if (!strcmp(what, "tier")) return tool_bench_tier(argc - 2, argv + 2);
        if (!strcmp(what, "tree")) return tool_bench_tree(argc - 2, argv + 2);
        if (!strcmp(what, "share")) return tool_bench_share(argc - 2, argv + 2);
        if (!strcmp(what, "mla")) return tool_bench_mla(argc - 2, argv + 2);
        if (!strcmp(what, "shift")) return tool_bench_shift(argc - 2, argv + 2);
        fprintf(stderr, "pkv bench: unknown benchmark '%s' (ops, attn, prefix, tier, tree, share, mla, shift)\n", what);
        return TOOL_USAGE;
    }
    fprintf(stderr, "pkv: unknown command '%s'\n\n", cmd);
    usage(stderr);
    return TOOL_USAGE;
}
