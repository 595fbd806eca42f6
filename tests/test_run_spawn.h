/* test_run_spawn.h: runs the pkv CLI (PKV_BIN) from the run/sim tests and captures its exit
 * status, stdout and stderr. Header-only (static functions) so it is not linked everywhere. */
#ifndef PKV_TEST_RUN_SPAWN_H
#define PKV_TEST_RUN_SPAWN_H

#include <fcntl.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* Path of the CLI: $PKV_BIN, else the build tree's. */
static inline const char *cli_path(void) {
    const char *b = getenv("PKV_BIN");
    if (b && *b) return b;
#ifdef PKV_BINARY_DIR
    return PKV_BINARY_DIR "/pkv";
#else
    return "pkv";
#endif
}

static inline char *slurp_fd(int fd) {
    struct stat st;
    if (fstat(fd, &st)) return NULL;
    char *buf = malloc((size_t)st.st_size + 1);
    if (!buf) return NULL;
    size_t n = 0;
    lseek(fd, 0, SEEK_SET);
    while (n < (size_t)st.st_size) {
        ssize_t r = read(fd, buf + n, (size_t)st.st_size - n);
        if (r <= 0) break;
        n += (size_t)r;
    }
    buf[n] = 0;
    return buf;
}

/* Runs argv (argv[0] is replaced by the CLI path). Returns the exit status, or 128 + signal
 * when it was killed, or -1 if it could not start. *out / *err (malloc'ed) get its output. */
static inline int run_cli(char **argv, char **out, char **err) {
    if (out) *out = NULL;
    if (err) *err = NULL;
    char o_path[] = "/tmp/pkv-test-out-XXXXXX", e_path[] = "/tmp/pkv-test-err-XXXXXX";
    int ofd = mkstemp(o_path), efd = mkstemp(e_path);
    if (ofd < 0 || efd < 0) return -1;
    unlink(o_path), unlink(e_path);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, ofd, 1);
    posix_spawn_file_actions_adddup2(&fa, efd, 2);
    argv[0] = (char *)cli_path();
    pid_t pid;
    int rc = posix_spawn(&pid, argv[0], &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    int status = -1;
    if (rc == 0) {
        int ws;
        if (waitpid(pid, &ws, 0) == pid) status = WIFEXITED(ws) ? WEXITSTATUS(ws) : 128 + WTERMSIG(ws);
    }
    char *o = slurp_fd(ofd), *e = slurp_fd(efd);
    close(ofd), close(efd);
    if (out) *out = o; else free(o);
    if (err) *err = e; else free(e);
    return status;
}

/* $PKV_SHARED_DIR/models/NAME (or the compile-time default), in a static buffer. */
static inline const char *shared_model(const char *name) {
    static char path[4096];
    const char *d = getenv("PKV_SHARED_DIR");
#ifdef PKV_SHARED_DIR
    if (!d || !*d) d = PKV_SHARED_DIR;
#endif
    if (!d) d = "../shared";
    snprintf(path, sizeof path, "%s/models/%s", d, name);
    return path;
}

#endif
