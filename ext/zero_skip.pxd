# Declarations of ext/zero_skip.h (the zero-skipping first-layer kernels) for the extensions
# that call them: ``from zero_skip cimport ...``.
cdef extern from "zero_skip.h" nogil:
    enum:
        HP_ISA_NONE
        HP_ISA_AVX2
        HP_ISA_AVX512
    ctypedef struct hp_plan:
        int isa
        int nb
    size_t hp_zskip_ints(int nb, int n_in)
    size_t hp_zskip_floats(int nb, int n_in)
    int hp_zskip_cpu_isa()
    int hp_zskip_supported(int isa)
    double hp_zskip_plan(hp_plan *pl, int isa, int nb, int n_in, const float *X,
                         int *iscratch, float *fscratch)
    void hp_zskip_forward(const hp_plan *pl, int n, const float *W, float *Z)
    void hp_zskip_update(const hp_plan *pl, int n, const float *D, float alpha, float *W,
                         float *W2)
