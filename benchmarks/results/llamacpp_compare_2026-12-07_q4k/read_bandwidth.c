#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <pthread.h>
static double now(){struct timespec t;clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static double wall(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
size_t N; char *buf;
typedef struct {size_t lo,hi; float r;} A;
void* rd(void*p){A*a=p;__m512 s=_mm512_setzero_ps(),s2=s;for(size_t i=a->lo;i<a->hi;i+=128){s=_mm512_add_ps(s,_mm512_load_ps((float*)(buf+i)));s2=_mm512_add_ps(s2,_mm512_load_ps((float*)(buf+i+64)));}a->r=_mm512_reduce_add_ps(_mm512_add_ps(s,s2));return 0;}
int main(int c,char**v){N=(size_t)atol(v[1])<<20;int T=atoi(v[2]);buf=aligned_alloc(64,N);for(size_t i=0;i<N;i++)buf[i]=i;
for(int rep=0;rep<5;rep++){double t0=wall(),c0=now();pthread_t th[8];A a[8];for(int i=0;i<T;i++){a[i].lo=N/T*i;a[i].hi=N/T*(i+1);if(T>1)pthread_create(th+i,0,rd,a+i);else rd(a);}for(int i=0;i<T&&T>1;i++)pthread_join(th[i],0);double t=wall()-t0,cc=now()-c0;printf("%zu MB T%d wall %.2f ms %.1f GB/s  (cpu %.2f ms)\n",N>>20,T,t*1e3,N/t/1e9,cc*1e3);}}
