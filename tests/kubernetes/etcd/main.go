// Command etcd is etcd's own server entry point, built from go.etcd.io/etcd/server/v3 at the
// version go.mod pins (the etcd module's main package lives in a module of its own).
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
