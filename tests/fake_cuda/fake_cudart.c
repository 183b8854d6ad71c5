/* A stand-in CUDA runtime for the tests of the stream path, on machines without a GPU. It is a test
 * tool, never a feature: it proves ordering and logic, not the GPU path.
 *
 * A stream handle is any pointer-sized value; each handle gets a FIFO served by one thread of its own,
 * started on first use. cudaLaunchHostFunc and cudaMemcpyAsync append to it; the thread runs the
 * entries in order. Test controls (fake_*) create handles, hold a stream (entries queue but do not
 * run) and release it, wait for it to drain, and count what ran.
 *
 * CUDA graphs as the real runtime has them: between fake_capture_begin and fake_capture_end a
 * stream is capturing (cudaStreamIsCapturing says so) and what is queued on it is recorded, not
 * run; fake_graph_launch queues the recorded entries again, as they were, each time it is called
 * (the same host functions with the same data, the same copies between the same addresses). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*host_fn)(void*);

struct entry {
  host_fn fn; /* NULL: a copy */
  void* data;
  void* dst;
  const void* src;
  size_t bytes;
  struct entry* next;
};

struct graph {
  struct entry *head, *tail;
};

struct stream {
  uintptr_t handle;
  struct graph* capturing; /* the graph being recorded, or NULL */
  pthread_cond_t changed;
  struct entry *head, *tail;
  int held, running, started;
  long executed, host_functions;
  struct stream* next;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct stream* streams;
static uintptr_t next_handle = 0x1000;

/* In a fork() child the serving threads are gone: queued entries never run there. */
static void after_fork_in_child(void) {
  pthread_mutex_init(&lock, NULL);
  for (struct stream* s = streams; s; s = s->next) {
    pthread_cond_init(&s->changed, NULL);
    s->started = -1; /* no thread serves it: entries queue and stay */
    s->running = 0;
  }
}

static void* serve(void* arg) {
  struct stream* s = arg;
  pthread_mutex_lock(&lock);
  for (;;) {
    while (s->held || !s->head) pthread_cond_wait(&s->changed, &lock);
    struct entry* e = s->head;
    s->head = e->next;
    if (!s->head) s->tail = NULL;
    s->running = 1;
    pthread_mutex_unlock(&lock);
    if (e->fn)
      e->fn(e->data);
    else
      memcpy(e->dst, e->src, e->bytes);
    pthread_mutex_lock(&lock);
    s->running = 0;
    s->executed++;
    if (e->fn) s->host_functions++;
    free(e);
    pthread_cond_broadcast(&s->changed);
  }
  return NULL;
}

static struct stream* find_locked(uintptr_t handle) {
  static int registered;
  if (!registered) registered = 1, pthread_atfork(NULL, NULL, after_fork_in_child);
  for (struct stream* s = streams; s; s = s->next)
    if (s->handle == handle) return s;
  struct stream* s = calloc(1, sizeof *s);
  s->handle = handle;
  pthread_cond_init(&s->changed, NULL);
  s->next = streams;
  streams = s;
  return s;
}

static void append(struct entry** head, struct entry** tail, struct entry* e) {
  if (*tail)
    (*tail)->next = e;
  else
    *head = e;
  *tail = e;
}

static int enqueue(uintptr_t handle, struct entry* e) {
  pthread_mutex_lock(&lock);
  struct stream* s = find_locked(handle);
  if (s->capturing) {
    append(&s->capturing->head, &s->capturing->tail, e);
    pthread_mutex_unlock(&lock);
    return 0;
  }
  if (!s->started) {
    pthread_t thread;
    if (pthread_create(&thread, NULL, serve, s) != 0) {
      pthread_mutex_unlock(&lock);
      free(e);
      return 2; /* cudaErrorMemoryAllocation */
    }
    pthread_detach(thread);
    s->started = 1;
  }
  append(&s->head, &s->tail, e);
  pthread_cond_broadcast(&s->changed);
  pthread_mutex_unlock(&lock);
  return 0;
}

int cudaLaunchHostFunc(void* stream, host_fn fn, void* data) {
  struct entry* e = calloc(1, sizeof *e);
  e->fn = fn, e->data = data;
  return enqueue((uintptr_t)stream, e);
}

int cudaMemcpyAsync(void* dst, const void* src, size_t bytes, int kind, void* stream) {
  (void)kind;
  struct entry* e = calloc(1, sizeof *e);
  e->dst = dst, e->src = src, e->bytes = bytes;
  return enqueue((uintptr_t)stream, e);
}

int cudaStreamIsCapturing(void* stream, int* status) {
  pthread_mutex_lock(&lock);
  *status = find_locked((uintptr_t)stream)->capturing != NULL; /* cudaStreamCaptureStatusActive */
  pthread_mutex_unlock(&lock);
  return 0;
}

const char* cudaGetErrorString(int status) { return status == 2 ? "fake: no thread for the stream" : "fake error"; }

/* ---- test controls ---- */

uintptr_t fake_stream_create(void) {
  pthread_mutex_lock(&lock);
  uintptr_t handle = next_handle++;
  find_locked(handle);
  pthread_mutex_unlock(&lock);
  return handle;
}

static void set_held(uintptr_t handle, int held) {
  pthread_mutex_lock(&lock);
  struct stream* s = find_locked(handle);
  s->held = held;
  pthread_cond_broadcast(&s->changed);
  pthread_mutex_unlock(&lock);
}

void fake_stream_hold(uintptr_t handle) { set_held(handle, 1); }
void fake_stream_release(uintptr_t handle) { set_held(handle, 0); }

/* Waits until every entry queued so far has run (the stream must not be held). */
void fake_stream_drain(uintptr_t handle) {
  pthread_mutex_lock(&lock);
  struct stream* s = find_locked(handle);
  while (s->started == 1 && (s->head || s->running)) pthread_cond_wait(&s->changed, &lock);
  pthread_mutex_unlock(&lock);
}

/* Entries run so far on the stream; host_functions: of them, host functions. */
long fake_stream_executed(uintptr_t handle) {
  pthread_mutex_lock(&lock);
  long n = find_locked(handle)->executed;
  pthread_mutex_unlock(&lock);
  return n;
}

long fake_stream_host_functions(uintptr_t handle) {
  pthread_mutex_lock(&lock);
  long n = find_locked(handle)->host_functions;
  pthread_mutex_unlock(&lock);
  return n;
}

long fake_stream_queued(uintptr_t handle) {
  pthread_mutex_lock(&lock);
  long n = 0;
  for (struct entry* e = find_locked(handle)->head; e; e = e->next) n++;
  pthread_mutex_unlock(&lock);
  return n;
}

/* ---- CUDA graphs ---- */

void fake_capture_begin(uintptr_t handle) {
  pthread_mutex_lock(&lock);
  find_locked(handle)->capturing = calloc(1, sizeof(struct graph));
  pthread_mutex_unlock(&lock);
}

/* Ends the capture; returns the graph (never freed: a test makes a few). */
void* fake_capture_end(uintptr_t handle) {
  pthread_mutex_lock(&lock);
  struct stream* s = find_locked(handle);
  struct graph* g = s->capturing;
  s->capturing = NULL;
  pthread_mutex_unlock(&lock);
  return g;
}

/* Queues every entry of the graph on the stream, in the order they were recorded. */
void fake_graph_launch(void* graph, uintptr_t handle) {
  for (struct entry* recorded = ((struct graph*)graph)->head; recorded; recorded = recorded->next) {
    struct entry* e = malloc(sizeof *e);
    *e = *recorded;
    e->next = NULL;
    enqueue(handle, e);
  }
}
