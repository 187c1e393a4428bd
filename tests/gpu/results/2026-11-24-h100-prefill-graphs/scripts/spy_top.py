import sys, collections
self_t, incl = collections.Counter(), collections.Counter()
tot = 0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1); n = int(n); tot += n
    frames = stack.split(";")
    self_t[frames[-1]] += n
    for f in set(frames): incl[f] += n
k = int(sys.argv[2]) if len(sys.argv) > 2 else 25
print("total", tot)
print("-- self"); [print(f"{100*v/tot:5.1f}% {f[:150]}") for f, v in self_t.most_common(k)]
print("-- inclusive"); [print(f"{100*v/tot:5.1f}% {f[:150]}") for f, v in incl.most_common(k)]
