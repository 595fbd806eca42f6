/* tier_file.c: the file store (pkv_tier_file_create): one file an entry in a directory, named by
 * its key (32 hex digits, ".pkvb"); the map holds each file's size in use order, and at most
 * `capacity` bytes of files are kept, the least recently used dropped first. A put writes a
 * temporary file (".pkvt-<pid>-<store>-<count>", never taken over) and renames it into place; a get opens the file
 * under the lock and reads it after, so an eviction meanwhile (an unlink) does not cut the read
 * short. */
#include "tier_int.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define NAME_LEN (2 * PKV__TIER_KEY + 5) /* hex digits and ".pkvb" */
/* a path: "dir/" and a name (an entry's, a temporary one, or any directory entry's: <= 255) */
#define PATH_BUF (PKV__TIER_DIR_MAX + 2 + 256)

typedef struct file_store {
    pkv__tstore s; /* first: the ops' ctx is also the base */
    uint64_t tmp_seq;
    size_t dir_len;
    char path[PKV__TIER_DIR_MAX + 2]; /* "dir/" (dir_len bytes) */
} file_store;

static void hex_name(char *out, const uint8_t *key) {
    static const char hx[] = "0123456789abcdef";
    for (int i = 0; i < PKV__TIER_KEY; i++) out[2 * i] = hx[key[i] >> 4], out[2 * i + 1] = hx[key[i] & 15];
    memcpy(out + 2 * PKV__TIER_KEY, ".pkvb", 6);
}

static bool parse_name(const char *name, uint8_t *key) {
    if (strlen(name) != NAME_LEN || strcmp(name + 2 * PKV__TIER_KEY, ".pkvb")) return false;
    for (int i = 0; i < 2 * PKV__TIER_KEY; i++) {
        const char ch = name[i];
        const int v = ch >= '0' && ch <= '9' ? ch - '0' : ch >= 'a' && ch <= 'f' ? ch - 'a' + 10 : -1;
        if (v < 0) return false;
        key[i / 2] = (uint8_t)(i % 2 ? key[i / 2] | v : v << 4);
    }
    return true;
}

/* "dir/<name>" into buf (PATH_BUF bytes) */
static char *path_of(const file_store *f, char *buf, const uint8_t *key) {
    memcpy(buf, f->path, f->dir_len);
    hex_name(buf + f->dir_len, key);
    return buf;
}

static bool write_all(int fd, const void *data, size_t len) {
    const unsigned char *p = data;
    while (len) {
        ssize_t w = write(fd, p, len);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w, len -= (size_t)w;
    }
    return true;
}

/* the base's hook: an entry dropped for room takes its file with it (under the lock) */
static void evicted(pkv__tstore *s, const pkv__tent *e) {
    char buf[PATH_BUF];
    unlink(path_of((const file_store *)s, buf, e->key));
}

static int file_put(void *ctx, const uint8_t key[16], const void *data, size_t len) {
    file_store *f = ctx;
    if (len > f->s.capacity) return PKV_ENOSPC;
    char tmp[PATH_BUF], fin[PATH_BUF];
    pkv__tent *e = pkv__tmap_new(&f->s.map, key, len, 0);
    if (!e) return PKV_ENOMEM;
    /* a name no other writer uses: this process, this store, a count; and should another
       process of the same pid (a container's) have it, the next count */
    int rc = PKV_OK, fd = -1;
    memcpy(tmp, f->path, f->dir_len);
    for (int tries = 0; fd < 0 && tries < 16; tries++) {
        pthread_mutex_lock(&f->s.mu);
        const uint64_t seq = f->tmp_seq++;
        pthread_mutex_unlock(&f->s.mu);
        snprintf(tmp + f->dir_len, sizeof tmp - f->dir_len, ".pkvt-%ld-%llx-%llu", (long)getpid(),
                 (unsigned long long)(uintptr_t)f, (unsigned long long)seq);
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 && errno != EEXIST) break;
    }
    if (fd < 0) rc = errno == ENOSPC || errno == EDQUOT ? PKV_ENOSPC : PKV_EIO;
    else {
        const bool ok = write_all(fd, data, len);
        const int err = ok ? 0 : errno;
        if (close(fd) != 0 || !ok) rc = err == ENOSPC || err == EDQUOT ? PKV_ENOSPC : PKV_EIO;
        if (rc) unlink(tmp);
    }
    if (!rc) {
        /* the map changes only once the file is in place: a failed rename leaves it as it was */
        pthread_mutex_lock(&f->s.mu);
        if (rename(tmp, path_of(f, fin, key)) == 0) {
            pkv__tstore_insert(&f->s, e);
            e = NULL;
        } else {
            rc = PKV_EIO;
            unlink(tmp);
        }
        pthread_mutex_unlock(&f->s.mu);
    }
    if (e) pkv__tmap_free(&f->s.map, e);
    return rc;
}

static bool read_all(int fd, void *data, size_t len) {
    unsigned char *p = data;
    while (len) {
        ssize_t r = read(fd, p, len);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        p += r, len -= (size_t)r;
    }
    return true;
}

static int file_get(void *ctx, const uint8_t key[16], void *data, size_t cap, size_t *len) {
    file_store *f = ctx;
    char buf[PATH_BUF];
    int fd = -1, rc = PKV_ENOENT;
    pthread_mutex_lock(&f->s.mu);
    pkv__tent *e = pkv__tmap_find(&f->s.map, key);
    if (e) {
        *len = (size_t)e->len;
        pkv__tmap_touch(&f->s.map, e);
        rc = data && e->len > cap ? PKV_ENOSPC : PKV_OK;
        if (data && !rc) {
            fd = open(path_of(f, buf, key), O_RDONLY | O_CLOEXEC);
            const int err = errno;
            if (fd < 0 && err == ENOENT) { /* gone from under the store (removed by hand): forget it */
                pkv__tstore_forget(&f->s, e);
                rc = PKV_ENOENT;
            } else if (fd < 0)
                rc = PKV_EIO; /* (out of descriptors, permissions: the entry stays) */
        }
    }
    pthread_mutex_unlock(&f->s.mu);
    if (fd >= 0) {
        struct stat st;
        /* a file of another size than the map's (changed by hand) reads as what it holds: the
           caller's checks refuse it */
        if (fstat(fd, &st) != 0) rc = PKV_EIO;
        else if ((uint64_t)st.st_size > cap) *len = (size_t)st.st_size, rc = PKV_ENOSPC;
        else if (!read_all(fd, data, (size_t)st.st_size)) rc = PKV_EIO;
        else *len = (size_t)st.st_size;
        close(fd);
    }
    return rc;
}

static int file_del(void *ctx, const uint8_t key[16]) {
    file_store *f = ctx;
    char buf[PATH_BUF];
    pthread_mutex_lock(&f->s.mu);
    pkv__tent *e = pkv__tmap_find(&f->s.map, key);
    if (e) {
        unlink(path_of(f, buf, key));
        pkv__tstore_forget(&f->s, e);
    }
    pthread_mutex_unlock(&f->s.mu);
    return PKV_OK;
}

static void file_destroy(void *ctx) {
    file_store *f = ctx;
    pkv_allocator a = f->s.map.alloc;
    pkv__tstore_fini(&f->s);
    pkv__free(&a, f, sizeof *f);
}

typedef struct found {
    uint8_t key[PKV__TIER_KEY];
    uint64_t len, when;
} found;

static int by_when(const void *a, const void *b) {
    const found *x = a, *y = b;
    return x->when < y->when ? -1 : x->when > y->when ? 1 : memcmp(x->key, y->key, PKV__TIER_KEY);
}

/* Takes over the entries already in the directory, oldest written first in the use order;
 * removes temporary files an hour old (left by a process that died writing them: a live
 * writer's, another process's on the same directory, are younger). */
static int adopt(file_store *f) {
    DIR *d = opendir(f->path);
    if (!d) return PKV_EIO;
    found *list = NULL;
    size_t n = 0, cap = 0;
    int rc = PKV_OK;
    const time_t now = time(NULL);
    char buf[PATH_BUF];
    for (struct dirent *de; (de = readdir(d));) {
        found x;
        const bool tmp = !strncmp(de->d_name, ".pkvt-", 6);
        if (!tmp && !parse_name(de->d_name, x.key)) continue;
        memcpy(buf, f->path, f->dir_len);
        strcpy(buf + f->dir_len, de->d_name);
        struct stat st;
        if (stat(buf, &st) != 0 || !S_ISREG(st.st_mode)) continue;
        if (tmp) { /* another writer's, in flight, unless an hour old: then left by a crash */
            if (now - st.st_mtime > 3600) unlink(buf);
            continue;
        }
        x.len = (uint64_t)st.st_size;
        x.when = (uint64_t)st.st_mtim.tv_sec * 1000000000u + (uint64_t)st.st_mtim.tv_nsec;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 64;
            found *g = pkv__alloc(&f->s.map.alloc, nc * sizeof *g, 16);
            if (!g) {
                rc = PKV_ENOMEM;
                break;
            }
            if (n) memcpy(g, list, n * sizeof *g);
            pkv__free(&f->s.map.alloc, list, cap * sizeof *list);
            list = g, cap = nc;
        }
        list[n++] = x;
    }
    closedir(d);
    if (n) qsort(list, n, sizeof *list, by_when);
    for (size_t i = 0; !rc && i < n; i++) {
        pkv__tent *e = pkv__tmap_new(&f->s.map, list[i].key, list[i].len, 0);
        if (!e) rc = PKV_ENOMEM;
        else pkv__tmap_insert(&f->s.map, e);
    }
    /* over the capacity (a smaller one than before): the oldest go */
    while (!rc && f->s.map.n && f->s.map.bytes > f->s.capacity) pkv__tstore_evict_oldest(&f->s);
    pkv__free(&f->s.map.alloc, list, cap * sizeof *list);
    return rc;
}

int pkv__tier_file_open(const char *dir, uint64_t capacity, const pkv_allocator *alloc, pkv_tier_ops *ops,
                        void **ctx) {
    const size_t dl = strlen(dir);
    if (dl > PKV__TIER_DIR_MAX) return PKV_EINVAL; /* (pkv_tier_file_create checks it first) */
    file_store *f = pkv__alloc(alloc, sizeof *f, 64);
    if (!f) return PKV_ENOMEM;
    memset(f, 0, sizeof *f);
    int rc = pkv__tstore_init(&f->s, capacity, alloc);
    if (rc) {
        pkv__free(alloc, f, sizeof *f);
        return rc;
    }
    f->s.evicted = evicted;
    f->dir_len = dl + 1;
    memcpy(f->path, dir, dl);
    f->path[dl] = '/';
    f->path[dl + 1] = 0;
    struct stat st;
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) rc = PKV_EIO;
    else if (stat(dir, &st) != 0 || !S_ISDIR(st.st_mode)) rc = PKV_EIO;
    else rc = adopt(f);
    if (rc) {
        file_destroy(f);
        return rc;
    }
    *ops = (pkv_tier_ops){file_put, file_get, file_del, pkv__tstore_usage, file_destroy};
    *ctx = f;
    return PKV_OK;
}
