/*
 * cuda.c: the CUDA driver, loaded at run time (cuda.h).
 */
#define _GNU_SOURCE
#include "cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

tdp_cuda_api_t tdp_cu;

static pthread_mutex_t tdp_cuda_mu = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int tdp_cuda_state; /* 0: not loaded, 1: loaded */
static int tdp_cuda_count;
static CUcontext tdp_cuda_ctx[TDP_CUDA_MAX_DEVICES];

int tdp_cuda_loaded(void)
{
    return atomic_load_explicit(&tdp_cuda_state, memory_order_acquire) == 1;
}

int tdp_cuda_graphs(void)
{
    return tdp_cuda_loaded() && tdp_cu.StreamBeginCapture && tdp_cu.StreamEndCapture && tdp_cu.GraphInstantiate &&
           tdp_cu.GraphLaunch && tdp_cu.GraphExecDestroy && tdp_cu.GraphDestroy && tdp_cu.LaunchHostFunc;
}

int tdp_cuda_devices(void)
{
    return tdp_cuda_loaded() ? tdp_cuda_count : 0;
}

const char *tdp_cuda_describe(CUresult r)
{
    const char *s = NULL;
    if (!tdp_cuda_loaded() || !tdp_cu.GetErrorString || tdp_cu.GetErrorString(r, &s) != 0 || !s)
        return "unknown CUDA error";
    return s;
}

int tdp_cuda_load(const char *path, char *err, size_t errlen)
{
    pthread_mutex_lock(&tdp_cuda_mu);
    if (tdp_cuda_loaded()) {
        pthread_mutex_unlock(&tdp_cuda_mu);
        return 0;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, errlen, "cannot load the CUDA driver %s: %s", path, dlerror());
        pthread_mutex_unlock(&tdp_cuda_mu);
        return -1;
    }
    tdp_cuda_api_t api;
    memset(&api, 0, sizeof api);
    static const struct {
        const char *name;
        size_t at;
        int optional;
    } syms[] = {
#define S(field, name) {name, offsetof(tdp_cuda_api_t, field), 0}
#define O(field, name) {name, offsetof(tdp_cuda_api_t, field), 1}
        S(Init, "cuInit"), S(DriverGetVersion, "cuDriverGetVersion"), S(DeviceGetCount, "cuDeviceGetCount"),
        S(DeviceGet, "cuDeviceGet"), S(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
        S(CtxSetCurrent, "cuCtxSetCurrent"), S(StreamCreate, "cuStreamCreate"), S(StreamDestroy, "cuStreamDestroy_v2"),
        S(StreamSynchronize, "cuStreamSynchronize"), S(EventCreate, "cuEventCreate"), S(EventRecord, "cuEventRecord"),
        S(EventQuery, "cuEventQuery"), S(EventSynchronize, "cuEventSynchronize"), S(EventDestroy, "cuEventDestroy_v2"),
        S(MemcpyAsync, "cuMemcpyAsync"), S(MemsetD8Async, "cuMemsetD8Async"), S(MemAlloc, "cuMemAlloc_v2"),
        S(MemFree, "cuMemFree_v2"), S(MemHostRegister, "cuMemHostRegister_v2"),
        S(MemHostUnregister, "cuMemHostUnregister"), S(GetErrorString, "cuGetErrorString"),
        S(EventElapsedTime, "cuEventElapsedTime"),
        O(StreamBeginCapture, "cuStreamBeginCapture_v2"), O(StreamEndCapture, "cuStreamEndCapture"),
        O(GraphInstantiate, "cuGraphInstantiateWithFlags"), O(GraphLaunch, "cuGraphLaunch"),
        O(GraphExecDestroy, "cuGraphExecDestroy"), O(GraphDestroy, "cuGraphDestroy"), O(LaunchHostFunc, "cuLaunchHostFunc"),
        O(StreamCreateWithPriority, "cuStreamCreateWithPriority"), O(CtxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange"),
#undef S
#undef O
    };
    for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++) {
        void *f = dlsym(h, syms[i].name);
        if (!f && syms[i].optional)
            continue;
        if (!f) {
            snprintf(err, errlen, "the CUDA driver %s has no %s", path, syms[i].name);
            dlclose(h);
            pthread_mutex_unlock(&tdp_cuda_mu);
            return -1;
        }
        memcpy((char *)&api + syms[i].at, &f, sizeof f);
    }
    int n = 0;
    CUresult r = api.Init(0);
    if (r == 0)
        r = api.DeviceGetCount(&n);
    if (r != 0 || n < 1) {
        const char *s = NULL;
        if (r == 0 || api.GetErrorString(r, &s) != 0 || !s)
            s = r == 0 ? "no CUDA device" : "unknown error";
        snprintf(err, errlen, "the CUDA driver %s does not start: %s (%d)", path, s, r);
        dlclose(h);
        pthread_mutex_unlock(&tdp_cuda_mu);
        return -1;
    }
    tdp_cu = api;
    tdp_cuda_count = n < TDP_CUDA_MAX_DEVICES ? n : TDP_CUDA_MAX_DEVICES;
    atomic_store_explicit(&tdp_cuda_state, 1, memory_order_release);
    pthread_mutex_unlock(&tdp_cuda_mu); /* (the library stays open for the process's life) */
    return 0;
}

CUresult tdp_cuda_use(int ordinal)
{
    if (ordinal < 0 || ordinal >= tdp_cuda_devices())
        return 101; /* CUDA_ERROR_INVALID_DEVICE */
    CUcontext c = __atomic_load_n(&tdp_cuda_ctx[ordinal], __ATOMIC_ACQUIRE);
    if (!c) {
        pthread_mutex_lock(&tdp_cuda_mu);
        c = tdp_cuda_ctx[ordinal];
        if (!c) {
            CUdevice d;
            CUresult r = tdp_cu.DeviceGet(&d, ordinal);
            if (r == 0)
                r = tdp_cu.DevicePrimaryCtxRetain(&c, d); /* the context CuPy's runtime uses too */
            if (r != 0) {
                pthread_mutex_unlock(&tdp_cuda_mu);
                return r;
            }
            __atomic_store_n(&tdp_cuda_ctx[ordinal], c, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&tdp_cuda_mu);
    }
    return tdp_cu.CtxSetCurrent(c);
}
