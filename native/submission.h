/*
 * submission.h: the client's submission state (transfer._native.Submission) and the push
 * that packs a call's requests into descriptors (Queue.push_requests). submission.c.
 */
#ifndef TRANSFER_SUBMISSION_H
#define TRANSFER_SUBMISSION_H

PyObject *Queue_push_requests(QueueObject *self, PyObject *const *a, Py_ssize_t na);
void bump_fork_generation(void);
int intern_names(void);

#endif /* TRANSFER_SUBMISSION_H */
