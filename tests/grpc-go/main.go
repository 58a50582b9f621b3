package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"os"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding"
)

type raw struct{}

func (raw) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (raw) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (raw) Name() string { return "proto" }

var _ encoding.Codec = raw{}

func main() {
	path := os.Args[1]
	conn, err := grpc.Dial(path,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, target string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", target)
		}),
	)
	if err != nil {
		panic(err)
	}
	defer conn.Close()
	for i := 2; i+1 < len(os.Args); i += 2 {
		body, err := hex.DecodeString(os.Args[i+1])
		if err != nil {
			panic(err)
		}
		var out []byte
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		err = conn.Invoke(ctx, os.Args[i], &body, &out, grpc.ForceCodec(raw{}))
		cancel()
		fmt.Printf("%s: err=%v out=%x\n", os.Args[i], err, out)
	}
}
