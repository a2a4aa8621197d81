/*
 * cuda.h: the few CUDA driver API calls the data plane's device work needs, loaded at run
 * time (dlopen of libcuda.so.1, or the library TRANSFER_CUDA_DRIVER names: the test suite's
 * fake driver). Only the prototypes are declared here, so no CUDA toolkit is needed to build;
 * without a driver the extension still loads and device requests go through the Python pass.
 */
#ifndef TRANSFER_CUDA_H
#define TRANSFER_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef unsigned long long CUdeviceptr;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
typedef void (*CUhostFn)(void *);

#define TDP_CUDA_SUCCESS 0
#define TDP_CUDA_NOT_READY 600
#define TDP_CUDA_ALREADY_REGISTERED 712
#define TDP_CUDA_STREAM_NON_BLOCKING 1u
#define TDP_CUDA_EVENT_DISABLE_TIMING 2u
#define TDP_CUDA_HOST_REGISTER_PORTABLE 1u
/* cuStreamBeginCapture's mode: only this thread's calls may disturb the capture. */
#define TDP_CUDA_CAPTURE_THREAD_LOCAL 1
/* Devices the data plane drives (contexts and per-worker streams are kept per ordinal). */
#define TDP_CUDA_MAX_DEVICES 16

typedef struct {
    CUresult (*Init)(unsigned);
    CUresult (*DriverGetVersion)(int *);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventQuery)(CUevent);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*MemcpyAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemHostRegister)(void *, size_t, unsigned);
    CUresult (*MemHostUnregister)(void *);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
    /* Optional (NULL where the driver lacks them: then graphs are not captured). */
    CUresult (*StreamBeginCapture)(CUstream, int);
    CUresult (*StreamEndCapture)(CUstream, CUgraph *);
    CUresult (*GraphInstantiate)(CUgraphExec *, CUgraph, unsigned long long);
    CUresult (*GraphLaunch)(CUgraphExec, CUstream);
    CUresult (*GraphExecDestroy)(CUgraphExec);
    CUresult (*GraphDestroy)(CUgraph);
    CUresult (*LaunchHostFunc)(CUstream, CUhostFn, void *);
    CUresult (*StreamCreateWithPriority)(CUstream *, unsigned, int);
    CUresult (*CtxGetStreamPriorityRange)(int *, int *);
} tdp_cuda_api_t;

/* The loaded driver's entry points (valid once tdp_cuda_load returned 0). */
extern tdp_cuda_api_t tdp_cu;

/* Load the driver at `path` and cuInit it: 0, or -1 with the reason in err. Once loaded it
 * stays loaded (a second call with any path returns 0). */
int tdp_cuda_load(const char *path, char *err, size_t errlen);
int tdp_cuda_loaded(void);
/* The driver can capture streams into graphs and launch them (and run host functions). */
int tdp_cuda_graphs(void);
/* Devices the driver sees (0 before a load). */
int tdp_cuda_devices(void);
/* Make `ordinal`'s primary context current on the calling thread: 0 or a CUresult. */
CUresult tdp_cuda_use(int ordinal);
/* The driver's name for an error ("CUDA_ERROR_..." or its description). */
const char *tdp_cuda_describe(CUresult r);

#endif /* TRANSFER_CUDA_H */
