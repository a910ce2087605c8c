#!/usr/bin/env python3
"""Print each crate's module import graph and any circle in it: a crate's modules form a
ladder (a module imports only from modules below it), and CI fails on a circle.
A module is a file under src/ (foo.rs and foo/ are one module `foo`; a file foo/bar.rs is
`foo::bar`, counted as part of `foo` for the ladder). An edge a -> b is any `crate::b`
path in a's files, or `super::b` resolving to a sibling. Usage: ladder.py CRATE_DIR..."""
import os, re, sys
from collections import defaultdict

def modules(src):
    out = {}
    for root, _, files in os.walk(src):
        for f in files:
            if not f.endswith('.rs'):
                continue
            p = os.path.join(root, f)
            rel = os.path.relpath(p, src)[:-3]
            parts = rel.split(os.sep)
            if parts[-1] == 'mod':
                parts = parts[:-1]
            if parts in (['lib'], ['main']):
                continue
            out[p] = parts
    return out

def top(parts):
    return parts[0]

def reexports(src, names):
    """Names that lib.rs re-exports from a module (`pub use foo::{A, b}`): `crate::A` is foo."""
    out = {}
    lib = os.path.join(src, 'lib.rs')
    if not os.path.exists(lib):
        return out
    text = open(lib, encoding='utf-8').read()
    for mod, body in re.findall(r'pub(?:\(crate\))? use (?:self::)?([a-z_][a-z0-9_]*)::(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)', text):
        if mod in names:
            for n in re.findall(r'[A-Za-z_][A-Za-z0-9_]*', body):
                out[n] = mod
    return out

def graph(src):
    mods = modules(src)
    names = {top(p) for p in mods.values()}
    rex = reexports(src, names)
    g = defaultdict(set)
    for path, parts in mods.items():
        text = open(path, encoding='utf-8', errors='replace').read()
        text = re.sub(r'#\[cfg\(test\)\]\s*mod tests\s*\{.*', '', text, flags=re.S)
        # Doc links and comments name modules without importing them.
        text = re.sub(r'//[^\n]*', '', text)
        me = top(parts)
        for m in re.findall(r'\bcrate::([A-Za-z_][A-Za-z0-9_]*)', text):
            m = rex.get(m, m)
            if m in names and m != me:
                g[me].add(m)
        # `crate::{a, b::c}` groups
        for grp in re.findall(r'\bcrate::\{([^}]*)\}', text):
            for m in re.findall(r'(?:^|,)\s*([A-Za-z_][A-Za-z0-9_]*)', grp):
                m = rex.get(m, m)
                if m in names and m != me:
                    g[me].add(m)
        if len(parts) == 1:
            for m in re.findall(r'\bsuper::([a-z_][a-z0-9_]*)', text):
                if m in names and m != me:
                    g[me].add(m)
    return names, g

def cycles(names, g):
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]
    def sc(v):
        index[v] = low[v] = n[0]; n[0] += 1; stack.append(v); on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                sc(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    sys.setrecursionlimit(10000)
    for v in sorted(names):
        if v not in index:
            sc(v)
    return out

bad = 0
for crate in sys.argv[1:]:
    src = os.path.join(crate, 'src')
    names, g = graph(src)
    cyc = cycles(names, g)
    print(f'== {crate}: {len(names)} modules, ' + ('no circle' if not cyc else f'{len(cyc)} circle(s)'))
    for v in sorted(names):
        print(f'  {v} -> {", ".join(sorted(g.get(v, ()))) or "-"}')
    for c in cyc:
        bad += 1
        print('  CIRCLE: ' + ' <-> '.join(c))
sys.exit(1 if bad else 0)
