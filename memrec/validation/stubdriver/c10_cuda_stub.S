/* A stand-in for PyTorch's libc10_cuda.so: USDT probes pytorch:malloc and pytorch:free (two free
 * sites) behind semaphores, with exactly the argument forms PyTorch 2.11's build has on x86-64:
 * malloc "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)" (pointer, device, size, stream), free "-8@%rdi".
 * Each function tests its semaphore first, as TORCH_SDT_IS_ENABLED does, so the probe fires only
 * once the kernel raised the semaphore through the uprobe's ref_ctr_offset.
 *
 *   void stub_torch_malloc(void *ptr, int device, size_t size, void *stream);
 *   void stub_torch_free(void *ptr);        (site 1)
 *   void stub_torch_free_other(void *ptr);  (site 2)
 *   unsigned short stub_semaphore(int which);  (0: malloc, 1: free)
 *
 * -DNOP5: the probe sites are 5-byte nops (libbpf's newer usdt.h) instead of sys/sdt.h's and
 * PyTorch's 1-byte nop: kernels from 6.18 on x86-64 can turn a uprobe there into a call instead
 * of a trap (bench/bench_tensor_probes.py measures both).
 */

#ifdef NOP5
#define PROBE_NOP .byte 0x0f, 0x1f, 0x44, 0x00, 0x00
#else
#define PROBE_NOP nop
#endif

#define NOTE(provider, name, sem, args)                         \
        .pushsection .note.stapsdt, "?", "note";               \
        .balign 4;                                             \
        .4byte 992f-991f, 994f-993f, 3;                        \
991:    .asciz "stapsdt";                                      \
992:    .balign 4;                                             \
993:    .8byte 990b;                                           \
        .8byte _.stapsdt.base;                                 \
        .8byte sem;                                            \
        .asciz provider;                                       \
        .asciz name;                                           \
        .asciz args;                                           \
994:    .balign 4;                                             \
        .popsection

        .pushsection .stapsdt.base, "aG", "progbits", .stapsdt.base, comdat
        .weak _.stapsdt.base
        .hidden _.stapsdt.base
_.stapsdt.base:
        .space 1
        .size _.stapsdt.base, 1
        .popsection

        .section .probes, "aw", @progbits
        .balign 2
        .globl pytorch_malloc_semaphore
        .hidden pytorch_malloc_semaphore
pytorch_malloc_semaphore:
        .2byte 0
        .globl pytorch_free_semaphore
        .hidden pytorch_free_semaphore
pytorch_free_semaphore:
        .2byte 0

        .text
        .globl stub_torch_malloc
        .type stub_torch_malloc, @function
stub_torch_malloc:
        push %rbp
        mov %rsp, %rbp
        push %r14
        sub $56, %rsp
        cmpw $0, pytorch_malloc_semaphore(%rip)
        je 1f
        mov %rdi, %rax
        mov %rdx, %r14
        mov %rcx, -56(%rbp)
        mov %esi, %edx
990:    PROBE_NOP
        NOTE("pytorch", "malloc", pytorch_malloc_semaphore, "-8@%rax -1@%dl -8@%r14 -8@-56(%rbp)")
1:      add $56, %rsp
        pop %r14
        pop %rbp
        ret
        .size stub_torch_malloc, .-stub_torch_malloc

        .globl stub_torch_free
        .type stub_torch_free, @function
stub_torch_free:
        cmpw $0, pytorch_free_semaphore(%rip)
        je 1f
990:    PROBE_NOP
        NOTE("pytorch", "free", pytorch_free_semaphore, "-8@%rdi")
1:      ret
        .size stub_torch_free, .-stub_torch_free

        .globl stub_torch_free_other
        .type stub_torch_free_other, @function
stub_torch_free_other:
        cmpw $0, pytorch_free_semaphore(%rip)
        je 1f
        xor %eax, %eax
990:    PROBE_NOP
        NOTE("pytorch", "free", pytorch_free_semaphore, "-8@%rdi")
1:      ret
        .size stub_torch_free_other, .-stub_torch_free_other

        .globl stub_semaphore
        .type stub_semaphore, @function
stub_semaphore:
        test %edi, %edi
        jne 1f
        movzwl pytorch_malloc_semaphore(%rip), %eax
        ret
1:      movzwl pytorch_free_semaphore(%rip), %eax
        ret
        .size stub_semaphore, .-stub_semaphore

        .section .note.GNU-stack, "", @progbits
